"""vLLM's engine in-process, for `bench.serving_overhead`: run with the vLLM venv's
interpreter (it imports vllm, not meshserve).

    <vllm-venv>/bin/python bench/vllm_inprocess_ttft.py PROMPTS.json OUTPUT_LEN DTYPE MODEL_DIR

Reads a JSON list of prompts (token-id lists), runs them one after the other through
`LLMEngine` with the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: no
API server, no ZMQ hop, the step loop in the caller's thread) and prints one JSON line:
the seconds from `add_request` to the first output token and to the last, per prompt.
Greedy, `ignore_eos`, every prompt generates OUTPUT_LEN tokens.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from vllm import EngineArgs, SamplingParams  # type: ignore[import-not-found]
from vllm.sampling_params import RequestOutputKind  # type: ignore[import-not-found]
from vllm.v1.engine.llm_engine import LLMEngine  # type: ignore[import-not-found]


def main(prompts_path: str, output_len: int, dtype: str, model_dir: str) -> None:
    prompts = json.loads(open(prompts_path).read())
    engine = LLMEngine.from_engine_args(EngineArgs(model=model_dir, dtype=dtype, max_model_len=1024))
    params = SamplingParams(
        max_tokens=output_len, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    timings = []
    for i, ids in enumerate(prompts):
        request_id = f"r{i}"
        submit = time.perf_counter()
        first, count, done = 0.0, 0, False
        engine.add_request(request_id, {"prompt_token_ids": ids}, params)
        while not done:
            for out in engine.step():
                if out.request_id != request_id:
                    continue
                new = len(out.outputs[0].token_ids)
                if new and not first:
                    first = time.perf_counter()
                count += new
                done = out.finished
        timings.append({"ttft_s": first - submit, "total_s": time.perf_counter() - submit, "tokens": count})
    print("RESULT " + json.dumps(timings), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
