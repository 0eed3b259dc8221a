"""The threshold (gamma) budget under the rule these tests were written for: a time band
(``tolerance``, formerly ``p``), raises up to the post-cut step time, no coverage bound."""

from sparsebalance.tuning import DSTConfig


def G(p: float = 0.1, **kwargs) -> DSTConfig:
    """``DSTConfig`` of the gamma rule with time band ``p`` (the old meaning of ``p``)."""
    kwargs.setdefault("raise_to", "step")
    return DSTConfig(budget="gamma", tolerance=p, p=1.0, **kwargs)
