"""What streaming a forced tool call's arguments costs the gateway: the reply read again whole at
every chunk (`first_call_so_far`, as the stream did before) against `CallScanner`, which keeps its
place and reads each character once. Both side by side in one run, on the same replies.

    .venv/bin/python bench/bench_call_stream.py [--chunk 4] [--repeat 3]

A reply is a Hermes-format forced call whose `content` argument is N characters of code; the
stream hands over the reply every `--chunk` characters (about one token). CPU seconds per reply
(`time.process_time`), the median of `--repeat` runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.core.call_stream import CallScanner, first_call_so_far


def prefill(name: str) -> str:
    return '<tool_call>\n{"name": "%s", "arguments": ' % name  # noqa: UP031


def reply_of(size: int) -> str:
    line = "def f(x):\n    return {'k': \"v\"}\n"
    content = (line * (size // len(line) + 1))[:size]
    return prefill("write") + json.dumps({"path": "a.py", "content": content}) + "}\n</tool_call>"


def cpu(run: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.process_time()
        run()
        times.append(time.process_time() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunk", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    print("| arguments (chars) | chunks | read whole each chunk (s) | CallScanner (s) | ratio |")
    print("|---|---|---|---|---|")
    for size in (1_000, 4_000, 16_000):
        reply = reply_of(size)
        cuts = [*range(0, len(reply), args.chunk), len(reply)]

        def whole(reply: str = reply, cuts: list[int] = cuts) -> object:
            return [first_call_so_far(reply[:c], ["write"], prefill) for c in cuts]

        def scanned(reply: str = reply, cuts: list[int] = cuts) -> object:
            scanner = CallScanner(["write"], prefill)
            return [scanner.scan(reply[:c]) for c in cuts]

        assert whole() == scanned()  # the same reading
        a, b = cpu(whole, args.repeat), cpu(scanned, args.repeat)
        print(f"| {size:,} | {len(cuts):,} | {a:.3f} | {b:.3f} | {a / b:.0f}x |")


if __name__ == "__main__":
    main()
