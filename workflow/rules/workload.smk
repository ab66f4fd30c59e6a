# Stage 1: the load profiles. With `load_profile_overrides`, a derived copy of the harness's
# profile is written beside the results (tracked), and every cell of the `default` load runs that
# copy; each of `extra_loads` is the default load with its own changes on top, written beside it.

if DERIVE_PROFILE:

    rule derive_load_profile:
        """The default load: the load profile with the config's overrides."""
        input:
            profile=config["load_profile"],
        output:
            profile=LOAD_PROFILE,
        params:
            overrides=config["load_profile_overrides"],
        log:
            f"{LOGS}/derive_load_profile.log",
        message:
            f"load profile ({PROFILE}): the default load"
        run:
            write_derived_profile(input.profile, params.overrides, output.profile, log[0])


if EXTRA_LOADS:

    rule derive_extra_load_profile:
        """An extra load (the `load` column): the default load with its own changes."""
        input:
            profile=config["load_profile"],
        output:
            profile=f"{OUT}/load_profile-{{load}}.yaml",
        params:
            overrides=lambda wc: [config.get("load_profile_overrides") or {},
                                  EXTRA_LOADS[wc.load]],
        log:
            f"{LOGS}/derive_load_profile-{{load}}.log",
        wildcard_constraints:
            load="|".join(EXTRA_LOADS),
        message:
            f"load profile ({PROFILE}): the load {{wildcards.load}}"
        run:
            write_derived_profile(input.profile, params.overrides, output.profile, log[0])
