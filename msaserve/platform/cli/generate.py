"""`msaserve generate`: prompt in, text out, on the CPU, through the replica engine (`LLMEngine`)."""

import argparse
import sys
import time

import torch

from msaserve.engine.config import EngineConfig
from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.model_loading import (
    CheckpointMismatch,
    LoadedModel,
    ModelFileMissing,
    ModelTooLarge,
    Tokenizer,
    UnsupportedModelType,
    load_model,
)
from msaserve.engine.types import GenerateRequest, SamplingParams
from msaserve.platform.cli.arg_types import positive_int


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate text from a prompt (CPU, one sequence)")
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument(
        "--model", default="smollm2",
        help="smollm2 (default), tiny, a checkpoint directory (model_type msa, llama, minimax_m3_vl, "
        "minimax_m3_vl_text) or a .gguf file",
    )
    parser.add_argument(
        "--attention",
        choices=("dense", "msa"),
        default="msa",
        help="attention backend: msa (block-sparse, default) or dense (the baseline)",
    )
    parser.add_argument("--max-tokens", type=positive_int, default=128, help="tokens to generate (≥ 1)")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 = greedy (default); otherwise sampling temperature in (0, 2]",
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    parser.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    parser.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wrap the prompt in the model's chat template (default on)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not 0.0 <= args.temperature <= 2.0:
        print(f"error: --temperature={args.temperature} is invalid: allowed 0.0 to 2.0", file=sys.stderr)
        return 2
    if not 0.0 < args.top_p <= 1.0:
        print(f"error: --top-p={args.top_p} is invalid: allowed (0, 1]", file=sys.stderr)
        return 2
    with torch.no_grad():  # scoped: `msaserve generate` called in-process must not turn autograd off after it
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        loaded = load_model(args.model, attention_backend=args.attention)
    except (ModelFileMissing, ModelTooLarge, UnsupportedModelType, CheckpointMismatch) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    tokenizer = loaded.tokenizer
    text = args.prompt
    if args.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    prompt_ids = tokenizer.encode(text)
    printer = _StreamPrinter(tokenizer)
    start = time.perf_counter()
    output = _generate(loaded, args, prompt_ids, printer)
    printer.finish()
    elapsed = time.perf_counter() - start
    print(
        f"[{len(prompt_ids)} prompt tokens, {len(output)} generated in {elapsed:.1f} s, "
        f"attention {args.attention}]",
        file=sys.stderr,
    )
    return 0


def _generate(
    loaded: LoadedModel, args: argparse.Namespace, prompt_ids: list[int], printer: "_StreamPrinter"
) -> list[int]:
    """One request through the engine, with a page pool just large enough for it."""
    max_len = len(prompt_ids) + args.max_tokens
    config = EngineConfig(
        model=args.model, attention_backend=args.attention, max_model_len=max_len, max_num_seqs=1,
        num_pages=-(-max_len // loaded.config.page_size) + 1, max_num_batched_tokens=2048,
    )
    engine = LLMEngine(config, model=loaded.model, tokenizer=loaded.tokenizer)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              seed=args.seed)
    engine.add_request(GenerateRequest("cli", prompt_ids, sampling))
    output: list[int] = []
    while engine.has_unfinished():
        for step_output in engine.step():
            for token in step_output.token_ids:
                output.append(token)
                printer.add(token)
    return output


class _StreamPrinter:
    """Prints text as tokens arrive; holds back an incomplete UTF-8 sequence (shown as U+FFFD)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.printed = 0

    def add(self, token_id: int) -> None:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        sys.stdout.write(text[self.printed :])
        sys.stdout.flush()
        self.printed = len(text)

    def finish(self) -> None:
        text = self.tokenizer.decode(self.ids)
        sys.stdout.write(text[self.printed :] + "\n")
        sys.stdout.flush()
