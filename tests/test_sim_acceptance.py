"""Acceptance models: draws against their defining probabilities, replay against brute force."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.fields import FieldError
from moesim.sim.analysis.speculation import tokens_per_pass
from moesim.sim.serving.acceptance import Geometric, Position, Recorded, Regime, geometric_count, survival_count

Z99 = 2.5758293035489004  # two-sided 99% normal quantile


def _draws(model, n: int, k_cap: int, rid: int = 0, seed: int = 3, position: int = 0) -> np.ndarray:
    state = model.bind(rid, n + 1, k_cap, seed)
    return np.array([state.draw(position) for _ in range(n)])


@given(
    u=st.lists(st.floats(min_value=1e-12, max_value=1.0), min_size=1, max_size=50),
    alpha=st.floats(min_value=0.0, max_value=1.0),
    k_cap=st.integers(0, 12),
)
@settings(max_examples=200, deadline=None)
def test_geometric_count_is_the_survival_count_of_alpha_powers(u: list[float], alpha: float, k_cap: int) -> None:
    """floor(ln u / ln α) capped = #{i <= k_cap : u < α^i}, the definition, for every u."""
    u_arr = np.array(u)
    survival = alpha ** np.arange(1, k_cap + 1, dtype=np.float64)
    expected = survival_count(u_arr, survival)
    got = geometric_count(u_arr, alpha, k_cap)
    # ties u == α^i exactly are measure-zero; floating rounding may move them by one
    ties = np.isclose(u_arr[:, None], survival[None, :], rtol=1e-12, atol=0).any(axis=1) if k_cap else np.zeros(len(u), bool)
    assert np.array_equal(got[~ties], expected[~ties])


@pytest.mark.parametrize(("alpha", "k"), [(0.3, 1), (0.6, 3), (0.85, 6)])
def test_geometric_mean_accepted_matches_tau(alpha: float, k: int) -> None:
    """E[min(k, A)] + 1 = τ(k, α); checked within the sample's 99% interval."""
    a = np.minimum(_draws(Geometric(alpha=alpha), 40_000, 8), k)
    half = Z99 * a.std(ddof=1) / math.sqrt(a.size)
    assert abs(a.mean() + 1 - float(tokens_per_pass(k, alpha))) <= half


def test_geometric_beta_alpha_per_request() -> None:
    """Beta(a, b) gives each request its own α: mean over requests a/(a+b), and a request's draws follow its α."""
    model = Geometric(beta=(6.0, 4.0))
    alphas = np.array([model.mean_alpha(r, 1) for r in range(4000)])
    sd = math.sqrt(6 * 4 / (10**2 * 11))
    assert abs(alphas.mean() - 0.6) <= Z99 * sd / math.sqrt(alphas.size)
    assert len(set(alphas[:10].round(12))) == 10
    a = _draws(model, 40_000, 30, rid=5, seed=1)
    alpha5 = model.mean_alpha(5, 1)
    # P(A >= 1) = α of request 5
    p = (a >= 1).mean()
    assert abs(p - alpha5) <= Z99 * math.sqrt(alpha5 * (1 - alpha5) / a.size)


def test_position_model_survival() -> None:
    """P(A >= i) = Π_{j<=i} α_j, the list's last value repeating beyond it."""
    model = Position(alphas=(0.9, 0.7, 0.5))
    a = _draws(model, 50_000, 5)
    survival = np.cumprod([0.9, 0.7, 0.5, 0.5, 0.5])
    for i, s in enumerate(survival, start=1):
        assert abs((a >= i).mean() - s) <= Z99 * math.sqrt(s * (1 - s) / a.size)
    tau = model.bind(0, 10, 5, 0).expected_tokens(0)
    assert tau == pytest.approx(np.concatenate([[1.0], 1.0 + np.cumsum(survival)]))


def test_regime_draws_follow_the_phase_at_each_position() -> None:
    """With α = 0 in one regime and 1 in the other, a draw is 0 or k_cap exactly by phase."""
    model = Regime(alphas=(0.0, 1.0), mean_phase_tokens=20.0)
    bounds, phase_alpha = model.schedule(rid := 4, 2000, seed=9)
    assert all(b2 > b1 for b1, b2 in itertools.pairwise(bounds))
    assert all(x != y for x, y in itertools.pairwise(phase_alpha))
    state = model.bind(rid, 2000, 6, 9)
    for position in range(0, 2000, 7):
        phase = int(np.searchsorted(bounds, position, side="right"))
        assert state.draw(position) == (6 if phase_alpha[phase] == 1.0 else 0)
        assert state.expected_tokens(position)[6] == pytest.approx(7.0 if phase_alpha[phase] == 1.0 else 1.0)


def test_regime_phase_lengths_and_choice() -> None:
    """Phase lengths are geometric with the configured mean; the next regime differs from the last."""
    model = Regime(alphas=(0.2, 0.5, 0.9), mean_phase_tokens=50.0)
    lengths, regimes = [], []
    for rid in range(200):
        bounds, phase_alpha = model.schedule(rid, 5000, seed=2)
        lengths += np.diff(bounds).tolist()
        regimes += phase_alpha
    lengths_arr = np.array(lengths, float)
    sd = math.sqrt((1 - 1 / 50) * 50**2)
    assert abs(lengths_arr.mean() - 50.0) <= Z99 * sd / math.sqrt(lengths_arr.size)
    counts = np.unique(regimes, return_counts=True)[1]
    assert counts.min() > 0.25 * len(regimes)


def _brute_force_replay(accepted: list[int], positions: int) -> list[int]:
    """Mark, position by position, whether the recorded run's draft there matched; A(p) = matched run from p."""
    matched: list[bool] = []
    for a in accepted:
        matched += [True] * a + [False]  # a accepted drafts, then the target's own token
    out = []
    for p in range(positions):
        run, q = 0, p % len(matched)
        while matched[q]:
            run += 1
            q += 1
        out.append(run)
    return out


@given(st.lists(st.integers(0, 4), min_size=1, max_size=30), st.integers(1, 4))
@settings(max_examples=100, deadline=None)
def test_recorded_replay_matches_brute_force(accepted: list[int], k_cap: int) -> None:
    model = Recorded(accepted=tuple(accepted), draft_len=4)
    state = model.bind(0, 10, k_cap, 0)
    total = sum(a + 1 for a in accepted)
    expected = _brute_force_replay(accepted, 2 * total)
    assert [state.draw(p) for p in range(2 * total)] == [min(e, k_cap) for e in expected]


def test_recorded_file_and_checks(tmp_path: Path) -> None:
    table = tmp_path / "counts.csv"
    table.write_text("seq,accepted,drafted\n0,2,3\n0,3,3\n1,0,3\n1,1,3\n")
    model = Recorded(file=table)
    assert model.draft_len == 3 and len(model.sequences) == 2
    assert model.bind(1, 10, 3, 0).draw(0) == 0  # request 1 replays sequence 1
    with pytest.raises(FieldError, match="drafted 3 tokens"):
        model.check_cap(4)
    with pytest.raises(FieldError, match="in \\[0, draft_len = 2\\]"):
        Recorded(accepted=(1, 3), draft_len=2)
    with pytest.raises(FieldError, match="no such file"):
        Recorded(file=tmp_path / "missing.csv", draft_len=2)


def test_same_request_same_draws() -> None:
    """Common random numbers: a request's draws depend on the seed and its id only."""
    model = Geometric(alpha=0.6)
    assert np.array_equal(_draws(model, 500, 8, rid=3), _draws(model, 500, 8, rid=3))
    assert not np.array_equal(_draws(model, 500, 8, rid=3), _draws(model, 500, 8, rid=4))


def test_invalid_models() -> None:
    with pytest.raises(FieldError, match=r"must lie in \[0, 1\], got 1.2"):
        Geometric(alpha=1.2)
    with pytest.raises(FieldError, match="exactly one"):
        Geometric()
    with pytest.raises(FieldError, match="at least two"):
        Regime(alphas=(0.5,))
