"""``LatencyModel``: predicted forward+backward seconds of micro-batches from a ``Profile``.

``predict = s_attn * sum_layers sum_docs attn(L, d) + s_other * layers * other(tokens)
+ s_head * head(tokens)``. Inside the profiled grid, attention is interpolated as a power law in
length and linearly in density (exact at grid points, monotone in both); outside it, an analytic
fit ``c0 + c1 L + c2 d L^2`` anchored at the grid edge takes over, with one warning per model
naming the inputs and the grid (:class:`OutsideGridWarning`). Predictions are never NaN or
negative. Batched prediction is pure numpy (10,000 micro-batches in milliseconds).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import numpy as np

from .calibration import ScaleFilter
from .profile import Profile, user_stacklevel

_FLOOR = 1e-9  # seconds: predictions stay strictly positive


class OutsideGridWarning(UserWarning):
    """A prediction outside the profile's tables: the fitted analytic form extrapolates there."""


def _check_densities(densities: np.ndarray) -> None:
    if np.any(~np.isfinite(densities) | (densities <= 0) | (densities > 1)):
        raise ValueError("densities must lie in (0, 1]")


def _monotone(table: np.ndarray) -> np.ndarray:
    """Running max along every axis: measurement noise must not make cost fall with work."""
    for axis in range(table.ndim):
        table = np.maximum.accumulate(table, axis=axis)
    return np.maximum(table, _FLOOR)


def _span(what: str, values: np.ndarray, grid_lo: float, grid_hi: float) -> str:
    """``document lengths 2..16 (grid 32..16,384)``: the range of ``values`` against the grid's."""
    lo, hi = _num(values.min()), _num(values.max())
    return f"{what} {lo}..{hi} (grid {_num(grid_lo)}..{_num(grid_hi)})"


def _num(x) -> str:
    x = float(x)
    return f"{int(x):,}" if x == int(x) and abs(x) >= 1 else f"{x:.3g}"


def measurement_noise(profile: Profile) -> float:
    """Relative noise of one measured micro-batch against this profile's prediction: its timing
    noise (CV of repeats) and its fit's leave-one-out error together, at least 5 % (analytic
    profiles record neither)."""
    cv = float(profile.noise.get("cv_median", 0.0) or 0.0)
    fit = float(profile.fit.get("loo_mape", 0.0) or 0.0)
    return max(float(np.hypot(cv, fit)), 0.05)


class LatencyModel:
    """Predicts micro-batch latency; implements :class:`sparsebalance.workload.CostModel`."""

    def __init__(self, profile: Profile):
        self.profile = profile
        self.num_layers = profile.num_layers
        att = profile.attention
        self._len = np.asarray(att.lengths, float)
        self._log_len = np.log(self._len)
        self._dens = np.asarray(att.densities, float)
        self._log_att = np.log(_monotone(np.asarray(att.seconds, float)))
        # Analytic form c0 + c1 L + c2 d L^2 fitted on the grid, for lengths outside it.
        grid_l, grid_d = np.meshgrid(self._len, self._dens, indexing="ij")
        design = np.stack([np.ones(grid_l.size), grid_l.ravel(), (grid_d * grid_l**2).ravel()], 1)
        coef, *_ = np.linalg.lstsq(design, np.exp(self._log_att).ravel(), rcond=None)
        self._att_fit = np.maximum(coef, 0.0)
        self._call = profile.attention_call_seconds
        self._other = self._table1d(profile.layer_other.tokens, profile.layer_other.seconds)
        self._head = self._table1d(profile.head.tokens, profile.head.seconds)
        # Online recalibration tracks two factors on top of the profile's own calibration:
        # attention, and everything proportional to tokens (layer rest + head). The rest and the
        # head both grow with tokens, so separate online factors for them are not identifiable;
        # the filter moves their level fast and the attention / rest split slowly (calibration.py).
        self._base = np.asarray(profile.scales, dtype=float)
        self.calibration = ScaleFilter(noise_std=measurement_noise(profile))
        self._warned = False

    # ------------------------------------------------------------------ tables
    @staticmethod
    def _table1d(tokens, seconds):
        x, y = np.asarray(tokens, float), _monotone(np.asarray(seconds, float))
        slope, intercept = np.polyfit(x, y, 1)
        return x, y, max(float(slope), 0.0), max(float(intercept), 0.0)

    def _lookup1d(self, table, tokens: np.ndarray) -> np.ndarray:
        x, y, slope, _ = table
        tokens = np.asarray(tokens, float)
        out = np.interp(tokens, x, y)
        outside = (tokens < x[0]) | (tokens > x[-1])
        if outside.any():
            self._warn_outside(lambda: [_span("micro-batch tokens", tokens[outside], x[0], x[-1])])
            edge = np.where(tokens < x[0], x[0], x[-1])
            out = np.where(outside, np.interp(edge, x, y) + slope * (tokens - edge), out)
        return np.maximum(out, _FLOOR)

    def _outside_documents(self, lengths: np.ndarray, densities: np.ndarray) -> list[str]:
        """What of these documents lies outside the attention table: lengths beyond its lengths,
        densities below its first density (for :meth:`_warn_outside`)."""
        out = []
        far = (lengths < self._len[0]) | (lengths > self._len[-1])
        if far.any():
            out.append(_span("document lengths", lengths[far], self._len[0], self._len[-1]))
        low = densities < self._dens[0]
        if low.any():
            out.append(_span("densities", densities[low], self._dens[0], 1.0))
        return out

    def _warn_outside(self, parts: Callable[[], list[str]]) -> None:
        """One :class:`OutsideGridWarning` per model, naming the inputs (the first ones seen;
        ``parts`` is called only then: later calls cost nothing)."""
        if not self._warned:
            self._warned = True
            warnings.warn(
                "latency model: inputs outside the profiled grid, priced by the fitted analytic "
                f"form there (said once per model): {'; '.join(parts())}",
                OutsideGridWarning,
                stacklevel=user_stacklevel(),
            )

    def _attention(self, lengths: np.ndarray, densities: np.ndarray) -> np.ndarray:
        """One layer, one document, without the per-call part (unscaled), elementwise."""
        return np.maximum(self._attention_call(lengths, densities) - self._call, _FLOOR)

    def _attention_call(self, lengths: np.ndarray, densities: np.ndarray) -> np.ndarray:
        """One layer's attention call on a single document (the profiled quantity)."""
        lengths, densities = np.broadcast_arrays(np.asarray(lengths, float), np.asarray(densities, float))
        if np.any(lengths <= 0):
            raise ValueError("document lengths must be > 0")
        _check_densities(densities)
        inside_l, li, wl = self._length_weights(lengths)
        dj, wd = self._density_weights(densities)

        def at(col):  # power-law interpolation along length, for density column `col`
            return np.exp(self._log_att[li, col] * (1 - wl) + self._log_att[li + 1, col] * wl)

        out = at(dj) * (1 - wd) + at(dj + 1) * wd  # linear in density (extrapolates below dmin)
        outside = (lengths != inside_l) | (densities < self._dens[0])
        if outside.any():
            self._warn_outside(lambda: self._outside_documents(lengths, densities))
            ratio = self._outside_ratio(lengths, inside_l, densities)
            out = np.where(lengths != inside_l, out * ratio, out)
        return np.maximum(out, _FLOOR)

    def _length_weights(self, lengths: np.ndarray):
        """Lengths clipped to the grid, their grid row ``li`` and log-length weight ``wl``."""
        inside_l = np.clip(lengths, self._len[0], self._len[-1])
        li = np.clip(np.searchsorted(self._len, inside_l, side="right") - 1, 0, len(self._len) - 2)
        wl = (np.log(inside_l) - self._log_len[li]) / (self._log_len[li + 1] - self._log_len[li])
        return inside_l, li, wl

    def _density_weights(self, densities: np.ndarray):
        """Grid column ``dj`` of each density and its linear weight ``wd``."""
        dj = np.clip(np.searchsorted(self._dens, densities, side="right") - 1, 0, len(self._dens) - 2)
        wd = (densities - self._dens[dj]) / (self._dens[dj + 1] - self._dens[dj])
        return dj, wd

    def _outside_ratio(self, lengths, inside_l, densities) -> np.ndarray:
        """Analytic fit at the true length over the fit at the grid edge (1 inside the grid)."""
        c0, c1, c2 = self._att_fit
        fit = c0 + c1 * lengths + c2 * densities * lengths**2
        fit_edge = c0 + c1 * inside_l + c2 * densities * inside_l**2
        return np.where(fit_edge > 0, fit / np.maximum(fit_edge, _FLOOR), 1.0)

    def _components(self, lengths, densities) -> np.ndarray:
        """Unscaled (attention, other, head) seconds of one micro-batch."""
        lengths = np.asarray(lengths, float).reshape(-1)
        if lengths.size == 0:
            raise ValueError("a micro-batch needs at least one document")
        d = np.asarray(densities, float)
        if d.ndim == 2:
            if d.shape != (self.num_layers, lengths.size):
                raise ValueError(f"per-layer densities must be (num_layers, N), got {d.shape}")
            attn = float(self._attention(lengths[None, :], d).sum())
        else:
            d = np.broadcast_to(d, lengths.shape)
            attn = self.num_layers * float(self._attention(lengths, d).sum())
        attn += self.num_layers * self._call  # once per layer, however many documents
        tokens = lengths.sum()
        other = self.num_layers * float(self._lookup1d(self._other, tokens))
        return np.array([attn, other, float(self._lookup1d(self._head, tokens))])

    # ------------------------------------------------------------------ CostModel
    @property
    def scales(self) -> np.ndarray:
        """Current (attention, rest of layer, head) factors: profile calibration x online."""
        att, rest = self.calibration.theta
        return self._base * np.array([att, rest, rest])

    def predict(self, lengths: Sequence[int], densities: float | Sequence[float] | np.ndarray) -> float:
        """Seconds of one micro-batch; densities scalar, ``(N,)`` or ``(num_layers, N)``."""
        return float(self.scales @ self._components(lengths, densities))

    def predict_many(self, lengths: np.ndarray, densities: np.ndarray) -> np.ndarray:
        """``(M, K)`` lengths (0 = empty slot) and densities -> ``(M,)`` seconds."""
        lengths = np.asarray(lengths, float)
        densities = np.broadcast_to(np.asarray(densities, float), lengths.shape)
        valid = lengths > 0
        attn = np.zeros(lengths.shape)
        attn[valid] = self._attention(lengths[valid], densities[valid])
        tokens = lengths.sum(-1)
        s = self.scales
        return (
            s[0] * self.num_layers * (attn.sum(-1) + self._call)
            + s[1] * self.num_layers * self._lookup1d(self._other, tokens)
            + s[2] * self._lookup1d(self._head, tokens)
        )

    def prepare(self, lengths: np.ndarray) -> PreparedLengths:
        """``predict_many`` for fixed ``(M, K)`` lengths (0 = empty slot) at many densities: the
        length half of the interpolation is done once (see :class:`PreparedLengths`)."""
        return PreparedLengths(self, lengths)

    def doc_seconds(self, lengths: np.ndarray, densities: np.ndarray) -> np.ndarray:
        s = self.scales
        per_token = s[1] * self.num_layers * self._other[2] + s[2] * self._head[2]
        attn = self._attention(lengths, densities)
        return s[0] * self.num_layers * attn + per_token * np.asarray(lengths, float)

    def microbatch_overhead(self) -> float:
        s = self.scales
        layer = s[0] * self._call + s[1] * self._other[3]
        return float(self.num_layers * layer + s[2] * self._head[3])

    def layer_attention_seconds(self, lengths: np.ndarray, densities: np.ndarray) -> np.ndarray:
        """One layer's attention per document (the per-call part is in ``layer_other_seconds``)."""
        return self.scales[0] * self._attention(lengths, densities)

    def layer_other_seconds(self, num_tokens: int) -> float:
        """One layer's non-attention part plus its attention call's fixed cost."""
        s = self.scales
        return float(s[1] * self._lookup1d(self._other, num_tokens) + s[0] * self._call)

    def layer_other_seconds_many(self, num_tokens: np.ndarray) -> np.ndarray:
        """:meth:`layer_other_seconds` of every entry of ``num_tokens`` (any shape), elementwise:
        the same values, in one call (the planner prices hundreds of micro-batches per step)."""
        s = self.scales
        return s[1] * self._lookup1d(self._other, np.asarray(num_tokens, float)) + s[0] * self._call

    def step_overhead(self) -> float:
        """Optimizer step + gradient all-reduce (once per step, not imbalanced)."""
        return self.profile.optimizer_seconds + (self.profile.allreduce_seconds or 0.0)

    # ------------------------------------------------------------------ recalibration
    def update(self, lengths: Sequence[int], densities, measured_seconds: float) -> None:
        """Fold a measured micro-batch time into the calibration (call once per micro-batch)."""
        x = self._base * self._components(lengths, densities)
        self.calibration.update(np.array([x[0], x[1] + x[2]]), float(measured_seconds))

    def state_dict(self) -> dict:
        return {"calibration": self.calibration.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.calibration.load_state_dict(state["calibration"])


class PreparedLengths:
    """:meth:`LatencyModel.predict_many` for one fixed ``(M, K)`` length array (0 = empty slot).

    What depends on lengths alone is computed once: each document's grid row and power-law weight,
    its interpolated seconds at every profiled density (``(D, num_densities)``, D documents), and
    each row's token-count lookups. ``predict(densities)`` then only locates each density in the
    grid: about 5x cheaper per call than ``predict_many``, for callers that price the same
    micro-batches at many densities (DST's bisection). Results are bit-for-bit ``predict_many``'s
    (the same elementwise operations and the same ``(M, K)`` row sums); the calibration scales are
    read at each call.
    """

    def __init__(self, model: LatencyModel, lengths: np.ndarray) -> None:
        lengths = np.asarray(lengths, float)
        if lengths.ndim != 2:
            raise ValueError(f"prepare: lengths must be (M, K), got shape {lengths.shape}")
        self.model = model
        self.shape = lengths.shape
        self._valid = lengths > 0
        # Row-major document index of every valid slot (-1 elsewhere), for take().
        self._doc = np.full(lengths.shape, -1, dtype=np.int64)
        self._doc[self._valid] = np.arange(int(self._valid.sum()))
        docs = lengths[self._valid]
        inside_l, li, wl = model._length_weights(docs)
        # exp(log_att[li, c] (1 - wl) + log_att[li + 1, c] wl) for every density column c: the
        # value _attention_call's at(c) computes, element for element.
        self._table = np.exp(model._log_att[li] * (1 - wl)[:, None] + model._log_att[li + 1] * wl[:, None])
        self._lengths, self._inside = docs, inside_l
        self._outside_l = docs != inside_l
        tokens = lengths.sum(-1)
        self._other = model._lookup1d(model._other, tokens)
        self._head = model._lookup1d(model._head, tokens)

    def take(self, rows: np.ndarray) -> PreparedLengths:
        """The same for the rows ``rows`` (int indices, increasing) only: ``(len(rows), K)``."""
        out = object.__new__(PreparedLengths)
        out.model = self.model
        out.shape = (len(rows), self.shape[1])
        out._valid = self._valid[rows]
        docs = self._doc[rows][out._valid]
        out._doc = np.full(out.shape, -1, dtype=np.int64)
        out._doc[out._valid] = np.arange(docs.size)
        out._table = self._table[docs]
        out._lengths, out._inside = self._lengths[docs], self._inside[docs]
        out._outside_l = self._outside_l[docs]
        out._other, out._head = self._other[rows], self._head[rows]
        return out

    def predict(self, densities: np.ndarray) -> np.ndarray:
        """``(M, K)`` densities (ignored in empty slots) -> ``(M,)`` seconds."""
        m = self.model
        d = np.broadcast_to(np.asarray(densities, float), self.shape)[self._valid]
        _check_densities(d)
        dj, wd = m._density_weights(d)
        flat = self._table.ravel()
        pos = np.arange(d.size) * self._table.shape[1] + dj
        out = flat[pos] * (1 - wd) + flat[pos + 1] * wd
        below = d < m._dens[0]
        if self._outside_l.any() or below.any():
            m._warn_outside(lambda: m._outside_documents(self._lengths, d))
            o = self._outside_l
            if o.any():
                out[o] = out[o] * m._outside_ratio(self._lengths[o], self._inside[o], d[o])
        call = np.maximum(out, _FLOOR)
        attn = np.zeros(self.shape)
        attn[self._valid] = np.maximum(call - m._call, _FLOOR)
        s = m.scales
        return s[0] * m.num_layers * (attn.sum(-1) + m._call) + s[1] * m.num_layers * self._other + s[2] * self._head
