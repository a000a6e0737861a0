"""Run one vLLM engine job for the plugin tests, in the vLLM environment (``.venv-vllm``): ``python engine.py JOB OUT``.

JOB (JSON): ``folder``, ``engine`` (keyword arguments of ``vllm.LLM``), ``prompts`` (lists of token ids),
``max_tokens``, optional ``prompt_logprobs`` (the top-1 token at every prompt position). OUT (JSON): each prompt's
generated ``outputs``, ``prompt_top1`` where asked, and the cache vLLM allocated (``num_blocks``, ``block_size``).
vLLM starts its engine in another process, hence the ``__main__`` guard.
"""

import json
import sys


def main(job_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.load(open(job_path))
    llm = LLM(model=job["folder"], **job.get("engine", {}))
    sp = SamplingParams(temperature=0, max_tokens=job.get("max_tokens", 16), ignore_eos=True,
                        prompt_logprobs=1 if job.get("prompt_logprobs") else None)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], sp, use_tqdm=False)
    res = {"outputs": [list(o.outputs[0].token_ids) for o in outs]}
    if job.get("prompt_logprobs"):
        res["prompt_top1"] = [[None if lp is None else next(t for t, x in lp.items() if x.rank == 1) for lp in o.prompt_logprobs]
                              for o in outs]
    cc = llm.llm_engine.vllm_config.cache_config
    res |= {"num_blocks": cc.num_gpu_blocks, "block_size": cc.block_size}
    json.dump(res, open(out_path, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:3])
