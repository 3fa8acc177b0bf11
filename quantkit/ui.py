"""What a person sees on long work: rich progress on stderr, one-line notes; silent under -q or --json."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

stderr = Console(stderr=True)
stdout = Console()


class Reporter:
    """Progress and notes for one command; `quiet` turns everything off (for -q and --json)."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet

    def note(self, msg: str) -> None:
        if not self.quiet:
            stderr.print(f"[yellow]note:[/] {msg}", highlight=False)

    @contextmanager
    def step(self, description: str) -> Iterator[None]:
        """A spinner for work of unknown length (loading a model, hashing)."""
        if self.quiet:
            yield
            return
        with stderr.status(description):
            yield

    @contextmanager
    def bar(self, description: str, total: int | None) -> Iterator[Callable[..., None]]:
        """A progress bar; yields `advance(n=1, total=None)`."""
        if self.quiet:
            yield lambda n=1, total=None: None
            return
        columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=stderr, transient=False) as progress:
            task = progress.add_task(description, total=total)

            def advance(n: int = 1, total: int | None = None) -> None:
                if total is not None:
                    progress.update(task, total=total)
                progress.advance(task, n)

            yield advance


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
