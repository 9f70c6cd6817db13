"""Run: .venv/bin/python examples/client_stream.py http://127.0.0.1:8000 "your question"

Streams one chat answer from a running router (`pdrouter launch` or examples/launch_pd.sh)
through the official openai client and prints its time to first token.
"""

from __future__ import annotations

import sys
import time

import openai


def main(base_url: str, question: str) -> None:
    api = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    model = api.models.list().data[0].id
    t0 = time.monotonic()
    first_s = None
    for chunk in api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=64, stream=True
    ):
        if chunk.choices and first_s is None:
            first_s = time.monotonic() - t0
        print("".join(c.delta.content or "" for c in chunk.choices), end="", flush=True)
    print(f"\n[model {model}; time to first token {first_s * 1000:.1f} ms]")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000",
         sys.argv[2] if len(sys.argv) > 2 else "Hello!")  # fmt: skip
