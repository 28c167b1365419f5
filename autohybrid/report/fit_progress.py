"""What `compiled.fit` shows while it trains: a rich progress bar on a terminal, plain log
lines otherwise.

`FitDisplay(show, total, start, log_every)` is entered around the loop and told each step
(`step`) and each note (`note`: a checkpoint written, a resume). Only the rank that shows
(rank 0) draws anything; `log_every=None` is silent. On a terminal (stdout a TTY) a bar
with the step, loss, learning rate, tokens/s and step time; elsewhere (a log file, a
pipe, CI) one line every `log_every` steps and at the last. It reads the numbers it is
given and starts nothing.
"""
from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)

from .terminal import format_seconds


class FitDisplay:
    def __init__(self, show: bool, total: int | None, start: int,
                 log_every: int | None) -> None:
        self.show = show and log_every is not None
        self.total, self.start, self.log_every = total, start, log_every
        self.tty = self.show and sys.stdout.isatty()
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        self._tokens, self._seconds = 0, 0.0  # since the last line drawn

    def __enter__(self) -> "FitDisplay":
        if self.tty:
            self._bar = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("lr {task.fields[lr]}"),
                TextColumn("{task.fields[speed]} tokens/s"),
                TextColumn("{task.fields[step_time]}/step"),
                TimeElapsedColumn(), TimeRemainingColumn(),
                console=Console(file=sys.stdout))
            self._task = self._bar.add_task("train", total=self.total, completed=self.start,
                                            loss="—", lr="—", speed="—", step_time="—")
            self._bar.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def step(self, step: int, epoch: int, loss: float, lr: float, step_s: float,
             tokens: int, last: bool = False) -> None:
        """Step `step` (compiled.step after it) of epoch `epoch` took `step_s` for
        `tokens`; tokens/s is over the steps since the last line (the bar: this step)."""
        if not self.show:
            return
        self._tokens += tokens
        self._seconds += step_s
        speed = f"{self._tokens / self._seconds:,.0f}" if self._seconds > 0 else "—"
        if self._bar is not None or last or step % self.log_every == 0:
            self._tokens, self._seconds = 0, 0.0
        if self._bar is not None:
            self._bar.update(self._task, completed=step, loss=f"{loss:.4f}", lr=f"{lr:.3g}",
                             speed=speed,
                             step_time=format_seconds(step_s))
            return
        if last or step % self.log_every == 0:
            of = f"/{self.total}" if self.total is not None else ""
            print(f"step {step}{of}  epoch {epoch}  loss {loss:.6f}  lr {lr:.4g}  "
                  f"{speed} tokens/s  {format_seconds(step_s)}/step", flush=True)

    def note(self, text: str) -> None:
        if not self.show:
            return
        if self._bar is not None:
            self._bar.console.print(text)
        else:
            print(text, flush=True)
