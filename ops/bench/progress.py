"""One progress bar (on stderr) over the planned units of work of a benchmark run."""

from __future__ import annotations

import sys


class Progress:
    """Units are a measured subprocess run or a serving load point; disabled, it only prints notes."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="run", dynamic_ncols=True, file=sys.stderr, desc="bench")

    def start(self, what: str) -> None:
        if self.bar is not None:
            self.bar.set_description_str(what[:60])
            self.bar.refresh()

    def done(self, n: int = 1, note: str | None = None) -> None:
        if self.bar is not None:
            if note:
                self.bar.set_postfix_str(note[:50], refresh=False)
            self.bar.update(n)

    def add(self, n: int) -> None:
        if self.bar is not None:
            self.bar.total += n
            self.bar.refresh()

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
