"""CPU part of the offline benchmark: SmolLM2-135M-Instruct through the engine against
`transformers` `generate` on the same prompts, same greedy token counts."""

import time

import torch

from msaserve.engine.config import EngineConfig
from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.types import GenerateRequest, SamplingParams
from msaserve.models.gguf_loader import smollm2_gguf_path
from msaserve.models.loader import load_model

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
    "List three uses of a paperclip.",
    "What does a compiler do?",
    "Give me a tip for learning to cook.",
    "Why do cats purr?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
]


def _engine_generate(engine: LLMEngine, prompts: list[list[int]], new_tokens: int, streams: int) -> float:
    """Generate `new_tokens` per prompt with at most `streams` in flight → seconds."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    pending = list(enumerate(prompts))
    in_flight = 0
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and in_flight < streams:
            i, ids = pending.pop(0)
            engine.add_request(GenerateRequest(f"p{i}-{time.perf_counter_ns()}", ids, params))
            in_flight += 1
        in_flight -= sum(o.finished for o in engine.step())
    return time.perf_counter() - start


def _hf_generate(model, prompts: list[list[int]], new_tokens: int, batched: bool, pad_id: int) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        if not batched:
            for ids in prompts:
                model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               do_sample=False, pad_token_id=pad_id)
        else:  # left padding, as generation with a batch needs
            width = max(len(p) for p in prompts)
            input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            model.generate(input_ids, attention_mask=mask, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
    return time.perf_counter() - start


def run_cpu_smollm2(new_tokens: int, threads: int, backend: str = "dense", repeats: int = 2
                    ) -> dict[str, float]:
    """tokens/s of one stream and of 8 concurrent streams, ours and transformers'."""
    import transformers

    torch.set_num_threads(threads)
    loaded = load_model("smollm2", attention_backend=backend, progress=False)
    tokenizer = loaded.tokenizer
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]))
               for p in PROMPTS]
    config = EngineConfig(model="smollm2", attention_backend=backend, num_pages=256, max_num_seqs=8,
                          max_num_batched_tokens=512, enable_prefix_caching=False)
    engine = LLMEngine(config, model=loaded.model, tokenizer=tokenizer)
    path = smollm2_gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    pad_id = 2
    total = new_tokens * len(prompts)
    _engine_generate(engine, prompts[:2], 4, 2)  # warm-up
    _hf_generate(hf, prompts[:2], 4, batched=True, pad_id=pad_id)
    # Best of `repeats` rounds, the four runs interleaved: the machine is shared, and the fastest
    # round is the one least disturbed by other processes.
    best = {"ours_1": 0.0, "ours_8": 0.0, "hf_1": 0.0, "hf_8": 0.0}
    for _ in range(repeats):
        runs = {
            "ours_1": lambda: _engine_generate(engine, prompts, new_tokens, streams=1),
            "ours_8": lambda: _engine_generate(engine, prompts, new_tokens, streams=8),
            "hf_1": lambda: _hf_generate(hf, prompts, new_tokens, batched=False, pad_id=pad_id),
            "hf_8": lambda: _hf_generate(hf, prompts, new_tokens, batched=True, pad_id=pad_id),
        }
        for name, run in runs.items():
            best[name] = max(best[name], total / run())
    ours_1, ours_8, hf_1, hf_8 = best["ours_1"], best["ours_8"], best["hf_1"], best["hf_8"]
    return {
        "cpu_smollm2_tok_s_1stream": ours_1,
        "cpu_smollm2_tok_s_8streams": ours_8,
        "cpu_hf_tok_s_1stream": hf_1,
        "cpu_hf_tok_s_8streams_batched": hf_8,
        "cpu_smollm2_8streams_vs_hf_1stream": ours_8 / hf_1,
        "cpu_smollm2_8streams_vs_hf_batched": ours_8 / hf_8,
        "cpu_smollm2_1stream_vs_hf_1stream": ours_1 / hf_1,
    }
