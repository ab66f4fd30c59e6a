# Stage 1: the load profile. With `load_profile_overrides`, a derived copy of the harness's
# profile is written beside the results (tracked), and every cell runs that copy.

if DERIVE_PROFILE:

    rule derive_load_profile:
        input:
            profile=config["load_profile"],
        output:
            profile=LOAD_PROFILE,
        params:
            overrides=config["load_profile_overrides"],
        log:
            f"{LOGS}/derive_load_profile.log",
        run:
            write_derived_profile(input.profile, params.overrides, output.profile, log[0])
