// k6 load test for POST /v1/completions: open-loop constant arrival rate, streamed responses.
//
//   k6 run deploy/loadtests/completions.js
//   k6 run -e BASE_URL=http://127.0.0.1:8000 -e RATE=4 -e DURATION=2m deploy/loadtests/completions.js
//   k6 run -e WORKLOAD=/path/workload.json deploy/loadtests/completions.js
//
// Mirrors config/benchmark-sharegpt.yaml: 4 requests/s, prompts of 4..512 tokens, max_tokens
// in [4, 128] (median about 64), ignore_eos (exact output lengths), temperature 0, seed 0.
// k6 cannot read the ShareGPT package, so by default prompts are seeded synthetic text whose
// lengths follow a clipped log-normal with ShareGPT-like first-turn lengths. For the exact
// benchmark requests, export them to JSON ([{"prompt": [ids] | "text", "max_tokens": n}, ...]):
//
//   python -c "import json; from llmserve.bench.workload import load_profile, build_workload; \
//     from llmserve.tokenizer import load_tokenizer; p, _ = load_profile('sharegpt'); \
//     w = build_workload(p, tokenizer=load_tokenizer(None), num_requests=256); \
//     json.dump([{'prompt': r.prompt_token_ids, 'max_tokens': r.max_tokens} for r in w.requests], \
//     open('workload.json', 'w'))"
//
// Metrics: k6's http_req_* plus ttft_ms (time to the first streamed chunk; k6 reads the whole
// body, so this is the response's waiting time), output_tokens and completion errors.

import http from 'k6/http';
import { check } from 'k6';
import { Counter, Trend } from 'k6/metrics';

const BASE_URL = __ENV.BASE_URL || 'http://127.0.0.1:8000';
const MODEL = __ENV.MODEL || 'tiny';
const RATE = Number(__ENV.RATE || 4);            // requests per second (profile arrival.rate)
const DURATION = __ENV.DURATION || '1m';
const SEED = Number(__ENV.SEED || 0);
const STREAM = (__ENV.STREAM || 'true') === 'true';

// Length distributions (tokens), as in config/benchmark-sharegpt.yaml (clipped ranges) with
// log-normal shapes: median/sigma of the unclipped distribution (natural-log units).
const PROMPT_LEN = { median: 64, sigma: 1.0, min: 4, max: 512 };
const OUTPUT_LEN = { median: 64, sigma: 0.8, min: 4, max: 128 };

// mulberry32: a small seeded PRNG, so every VU draws the same request sequence for a seed.
function rng(seed) {
  let a = seed >>> 0;
  return function () {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function normal(rand) {
  // Box-Muller
  const u = Math.max(rand(), 1e-12);
  const v = rand();
  return Math.sqrt(-2 * Math.log(u)) * Math.cos(2 * Math.PI * v);
}

function lognormalInt(rand, spec) {
  const x = Math.round(Math.exp(Math.log(spec.median) + spec.sigma * normal(rand)));
  return Math.min(spec.max, Math.max(spec.min, x));
}

const WORDS = ('the a of to and in is it that for on with as was at by an be this which or from ' +
  'paged attention cache block token batch schedule prefill decode memory kernel latency ' +
  'throughput request model layer query key value head softmax queue serve stream').split(' ');

function syntheticWorkload(n, seed) {
  const rand = rng(seed);
  const out = [];
  for (let i = 0; i < n; i++) {
    const plen = lognormalInt(rand, PROMPT_LEN);   // about one token per common English word
    const words = [];
    for (let j = 0; j < plen; j++) words.push(WORDS[Math.floor(rand() * WORDS.length)]);
    out.push({ prompt: words.join(' '), max_tokens: lognormalInt(rand, OUTPUT_LEN) });
  }
  return out;
}

// Init context: load or build the request list once per VU.
const REQUESTS = __ENV.WORKLOAD ? JSON.parse(open(__ENV.WORKLOAD)) : syntheticWorkload(1024, SEED);

export const options = {
  scenarios: {
    completions: {
      executor: 'constant-arrival-rate',
      rate: RATE,
      timeUnit: '1s',
      duration: DURATION,
      preAllocatedVUs: Number(__ENV.PREALLOCATED_VUS || 32),
      maxVUs: Number(__ENV.MAX_VUS || 256),
    },
  },
  thresholds: {
    http_req_failed: ['rate<0.01'],
    completion_errors: ['count<1'],
  },
  summaryTrendStats: ['avg', 'min', 'med', 'p(90)', 'p(95)', 'p(99)', 'max'],
};

const ttft = new Trend('ttft_ms', true);
const outputTokens = new Counter('output_tokens');
const errors = new Counter('completion_errors');

export default function () {
  const req = REQUESTS[(__ITER * 7919 + __VU * 104729) % REQUESTS.length];
  const body = {
    model: MODEL,
    prompt: req.prompt,
    max_tokens: req.max_tokens,
    temperature: 0,
    ignore_eos: true,
    stream: STREAM,
  };
  if (STREAM) body.stream_options = { include_usage: true };
  const res = http.post(`${BASE_URL}/v1/completions`, JSON.stringify(body), {
    headers: { 'Content-Type': 'application/json' },
    timeout: '300s',
    tags: { name: 'completions' },
  });
  const ok = check(res, {
    'status is 200': (r) => r.status === 200,
    'stream ends with [DONE]': (r) => !STREAM || (typeof r.body === 'string' && r.body.includes('data: [DONE]')),
  });
  if (!ok) {
    errors.add(1);
    return;
  }
  ttft.add(res.timings.waiting);
  let usage = null;
  if (STREAM) {
    for (const line of res.body.split('\n')) {
      if (!line.startsWith('data: ') || line === 'data: [DONE]') continue;
      const chunk = JSON.parse(line.slice(6));
      if (chunk.error) errors.add(1);
      if (chunk.usage) usage = chunk.usage;
    }
  } else {
    usage = res.json('usage');
  }
  if (usage) outputTokens.add(usage.completion_tokens);
}
