"""Which weights a run keeps: the best validation epoch only when it beats the last beyond noise.

Picking the best of E epochs on n validation queries is biased upward: with equally good
weights the maximum of E noisy recalls still beats the last one. Recall@10 over n distinct
queries is a proportion with binomial standard error ``se = sqrt(p (1 - p) / n)``; the best
epoch is kept only when ``best - last > factor * se`` (p: the mean of the two). With
``factor = 2`` a single comparison is a one-sided test at about 2.3%; epochs are scored on
the same queries by neighbouring weights, so two evaluations are strongly correlated and
the noise of their difference is at most about one ``se`` (it is ``se * sqrt(2 (1 - rho))``,
<= se for rho >= 0.5), which leaves room for the upward bias of taking the maximum.
Otherwise the last weights are kept: they fit the training collection best, and that is
the collection users index.

Early stopping (``--patience P``) uses the same rule: the reference epoch is the first, and
an epoch that beats the reference by more than ``factor * se`` becomes the reference;
training stops once P epochs in a row have not (``early_stop``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

DEFAULT_FACTOR = 2.0  # standard errors the best epoch must gain over the last


@dataclass(frozen=True)
class Selection:
    """The decision and the numbers behind it (``RUN/selection.json``)."""

    kept: str  # "best" or "last"
    metric: str  # the validation metric compared, e.g. t2i_r10
    best_epoch: int  # the epoch with the highest value (the first one on ties)
    best_value: float
    last_epoch: int
    last_value: float
    queries: int  # distinct validation queries the metric averages over
    stderr: float  # binomial standard error sqrt(p (1 - p) / queries), p = mean of the two values
    factor: float  # the gain must exceed factor * stderr
    threshold: float  # factor * stderr

    @property
    def kept_epoch(self) -> int:
        return self.best_epoch if self.kept == "best" else self.last_epoch

    def to_dict(self) -> dict:
        return {**asdict(self), "kept_epoch": self.kept_epoch}

    def reason(self) -> str:
        """One or two sentences with the numbers."""
        if self.best_epoch == self.last_epoch:
            return f"Best epoch: the last, {self.last_epoch} ({self.metric} {self.last_value:.4f}): kept it."
        gain = self.best_value - self.last_value
        head = (
            f"Best epoch: {self.best_epoch} ({self.metric} {self.best_value:.4f}), ahead of the last, epoch"
            f" {self.last_epoch} ({self.last_value:.4f}), by {gain:.4f}"
        )
        noise = (
            f"{self.factor:g} x {self.stderr:.4f} = {self.threshold:.4f}"
            f" ({self.factor:g} binomial standard errors at the two epochs' mean recall, over {self.queries} distinct"
            " validation queries)"
        )
        if self.kept == "best":
            return f"{head} > {noise}: kept the best epoch."
        return f"{head} <= {noise}: within noise, kept the last weights."


def select(
    best: tuple[int, float], last: tuple[int, float], queries: int, factor: float = DEFAULT_FACTOR, metric: str = "t2i_r10"
) -> Selection:
    """Keep ``best`` = (epoch, value) over ``last`` only when its gain exceeds ``factor`` standard errors.

    ``factor = 0`` keeps the best whenever it is higher (plain model selection).
    """
    (best_epoch, best_value), (last_epoch, last_value) = best, last
    n = max(int(queries), 1)
    p = min(max((best_value + last_value) / 2, 1.0 / n), 1.0 - 1.0 / n) if n > 1 else 0.5
    stderr = math.sqrt(p * (1 - p) / n)
    threshold = factor * stderr
    kept = "best" if best_epoch == last_epoch or best_value - last_value > threshold else "last"  # same weights when equal
    return Selection(kept, metric, best_epoch, best_value, last_epoch, last_value, n, stderr, factor, threshold)


STOP_RULE = (
    "stop once --patience epochs in a row have not beaten the reference epoch's validation {metric} by more than"
    " --select-factor binomial standard errors (the reference: the first epoch, then each epoch that did)"
)


@dataclass(frozen=True)
class EarlyStop:
    """Why training stopped before its last epoch (``RUN/selection.json``, ``early_stopping``)."""

    stopped_epoch: int  # the last epoch trained
    epochs: int  # the epochs the run was given
    reference_epoch: int  # the last epoch that beat its reference beyond noise (or the first)
    reference_value: float
    best_since: float  # the highest value of the epochs after the reference
    threshold: float  # factor * stderr at the stop (best_since against the reference)
    patience: int
    factor: float
    metric: str

    def reason(self) -> str:
        return (
            f"Stopped early after epoch {self.stopped_epoch} of {self.epochs}: the {self.patience} epochs after epoch"
            f" {self.reference_epoch} ({self.metric} {self.reference_value:.4f}) did not beat it by more than"
            f" {self.threshold:.4f} (best {self.best_since:.4f}; {self.factor:g} standard errors at the mean recall of"
            f" the two compared, --patience {self.patience})."
        )


def early_stop(
    values: Sequence[float], queries: int, patience: int, epochs: int, factor: float = DEFAULT_FACTOR, metric: str = "t2i_r10"
) -> EarlyStop | None:
    """Whether to stop after the epochs scored ``values`` (epoch i + 1 scored ``values[i]``); None: go on.

    ``patience <= 0`` never stops. The rule is ``select``'s: an epoch counts as an improvement only
    when it beats the reference epoch beyond noise (STOP_RULE).
    """
    if patience <= 0 or len(values) >= epochs:
        return None
    ref = 0
    for i in range(1, len(values)):
        if select((i + 1, values[i]), (ref + 1, values[ref]), queries, factor, metric).kept == "best":
            ref = i
    if len(values) - 1 - ref < patience:
        return None
    best = max(values[ref + 1 :])
    decision = select((len(values), best), (ref + 1, values[ref]), queries, factor, metric)
    return EarlyStop(len(values), epochs, ref + 1, values[ref], best, decision.threshold, patience, factor, metric)


def select_from_history(values: Sequence[float], queries: int, factor: float = DEFAULT_FACTOR, metric: str = "t2i_r10") -> Selection:
    """The same on per-epoch values (epoch i + 1 scored ``values[i]``); the best is the first maximum."""
    if not values:
        raise ValueError("no evaluations to select from")
    best = max(range(len(values)), key=lambda i: (values[i], -i))
    return select((best + 1, values[best]), (len(values), values[-1]), queries, factor, metric)
