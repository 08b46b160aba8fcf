"""`msaserve chat`: a streaming terminal client (the official `openai` package) for a running server."""

import argparse
import os
import sys
import uuid

DEFAULT_URL = "http://127.0.0.1:8000/v1"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("chat", help="Chat with a running msaserve server in the terminal.")
    p.add_argument("--url", default=DEFAULT_URL, help=f"API base URL (default {DEFAULT_URL}).")
    p.add_argument("--api-key", default=os.environ.get("MSASERVE_API_KEY", "none"),
                   help="API key (default: $MSASERVE_API_KEY).")  # fmt: skip
    p.add_argument("--model", help="Model name (default: the server's first model).")
    p.add_argument("--system", help="System prompt.")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument(
        "--session", help="X-Session-Id to keep the conversation's pages cached (default: random)."
    )
    p.add_argument("--once", metavar="MESSAGE", help="Ask one question, print the answer and exit.")
    p.set_defaults(func=run)


def stream_reply(client, model: str, messages: list[dict], args: argparse.Namespace, session: str) -> str:
    stream = client.chat.completions.create(
        model=model, messages=messages, stream=True, temperature=args.temperature,
        max_tokens=args.max_tokens, extra_headers={"X-Session-Id": session},
    )  # fmt: skip
    parts = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()
    return "".join(parts)


def run(args: argparse.Namespace) -> int:
    import openai

    client = openai.OpenAI(base_url=args.url, api_key=args.api_key, max_retries=1)
    try:
        model = args.model or client.models.list().data[0].id
    except openai.APIError as e:
        print(f"msaserve chat: cannot reach {args.url}: {e}", file=sys.stderr)
        return 1
    session = args.session or uuid.uuid4().hex
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    if args.once:
        messages.append({"role": "user", "content": args.once})
        stream_reply(client, model, messages, args, session)
        return 0
    print(
        f"Chatting with {model} at {args.url} (session {session}). Ctrl-D or /exit quits, /reset restarts."
    )
    while True:
        try:
            text = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": text})
        print("assistant> ", end="", flush=True)
        try:
            messages.append(
                {"role": "assistant", "content": stream_reply(client, model, messages, args, session)}
            )
        except openai.APIError as e:
            print(f"\n[error] {e}", file=sys.stderr)
            messages.pop()
