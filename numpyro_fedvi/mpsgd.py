"""MPSGD: minibatch projected SGD for location-scale VI (Labarrière, Molinari, Villa, Rosasco 2026).

Objective (specs/mpsgd.md): ``L(μ, Σ) = E_z f(μ + Σz) − log|det Σ|`` with ``f`` the model's potential energy in
unconstrained space (Jacobian included) and ``z`` from a standardized elliptic base; ``L`` is the negative ELBO up
to the constant ``−H(base)``.  One iteration ``k`` (eq. (MPSGD)):

    Z = (z_1..z_N) ~ base,  X = μ + ΣZ,  G = ∇f(X)                               (same z for both blocks)
    g_μ = G1/N,  g_Σ = GZᵀ/N − Σ^{-T}   (tril: tril(GZᵀ/N) − diag(1/C_ii);  diag: mean(G∘Z) − 1/s)
    μ ← μ − γ_k λ_μ g_μ,   Σ ← P_{Θ_L}(Σ − γ_k λ_Σ g_Σ),   Θ_L = {σ_min(Σ) ≥ 1/√L}

with the iterate average ``θ̄_K = Σ_k w_k θ^k / Σ_k w_k``, ``w_k = γ_k α_{k+1}``, ``α_{k+1} = Π_{i≤k} τ_i``,
``τ_i = 1/(1 + a γ_i²/N_i)`` (Theorems 6 and 7; constant γ, N: ``w_k ∝ τ^{k+1}``).  Growing batches ``N_k`` are
drawn in fixed-size chunks inside one compiled loop (no recompilation).

Functional core: :func:`mpsgd_init`, :func:`make_mpsgd_step` (the paper's schedule, ``schedule="theory"``) and
:mod:`numpyro_fedvi.whitening` (the default ``schedule="adaptive"``: the same step in stages of affine whitening);
front-end :class:`MPSGD` with NumPyro's SVI surface.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, random
from numpyro import handlers
from numpyro.distributions.transforms import biject_to

from .curvature import lbfgs_minimize
from .enumeration import enum_info_of_trace, potential_fn, read_abstract_trace
from .guides import apply_scale, log_abs_det_scale
from .inputs import (
    InputJit,
    arguments_left_out,
    array_arguments,
    as_typed_key,
    check_guide_built,
    check_inputs_like,
    check_positive,
    check_state_precision,
    check_static_kwargs,
    concrete_data_fallback,
    is_real_number,
    prepare_inputs,
    shapes_noted,
    split_inputs,
)
from .objectives import without_imputed_entries
from .runner import (
    EarlyStopping,
    RunResult,
    check_quarter_move,
    quarter_snapshots,
    revert_non_finite,
    run_loop,
    tree_all_finite,
)
from .schedules import batch_growth, constant, dynamic_batching, theorem4
from .structure import imputation_sites, observation_plates, warn_dependent_supports
from .user_warnings import against, warn
from .whitening import WhitenedState, make_whitened_step, project_scale, whitened_init, whitened_params

THEORY_STEP_WARN = 1e4  # (theory) a float step_size above THEORY_STEP_WARN / L is warned about (1/(2L): theory)
MIN_STAGES = 3          # adaptive: a run counts as converged after this many stages ...
CONVERGED_MOVE = 0.1    # ... when the last one moved the mean and the scale by at most this (posterior sd / rel.)
# a not-converged warning adds far_start_advice when the last stage moved the mean by more than this (posterior sd): a
# heteroscedastic regression from init_to_uniform (log sd = c + d·x, x in [0, 10]) sat at loss 1.4e12 after 4,000 steps,
# its stages moving the mean 150-1,200 sd at the per-step trust cap, q's sd 1e-7 (it never arrives); from 4 other keys
# the last stage of a converging run moved it 0.8-4.8 sd at 500 steps (138 at one that arrived by 4,000), 2026-12-01
FAR_MOVE = 10.0
MIN_RADII = 4           # adaptive: at least this many ± pairs (radii) per step: 2·max(d, MIN_RADII) draws
PER_DATUM_WARN_DIM = 200  # warn when at least this many latent coordinates sit in the plate of the observations

__all__ = ["MPSGD", "MPSGDState", "estimate_smoothness", "make_mpsgd_step", "mc_gradient", "mpsgd_init",
           "project_scale"]


class MPSGDState(NamedTuple):
    """``loc`` μ (d,), ``scale`` Σ (raw: (d,d) full/tril or (d,) diag), ``scale_inv`` Σ^{-1} (full; else an
    unused 0), ``scale_logdet`` log|det Σ| (from the projection), running average ``avg_loc``/``avg_scale`` with
    ``log_weight_sum`` = log Σ w, ``log_alpha`` = log α_k, the averaging constant ``avg_a`` (a of τ), ``step`` k,
    base ``rng_key``."""

    loc: jax.Array
    scale: jax.Array
    scale_inv: jax.Array
    scale_logdet: jax.Array
    avg_loc: jax.Array
    avg_scale: jax.Array
    log_weight_sum: jax.Array
    log_alpha: jax.Array
    avg_a: jax.Array
    step: jax.Array
    rng_key: jax.Array


def mpsgd_init(loc, scale, scale_type: str, min_scale, rng_key, avg_a=1.0) -> MPSGDState:
    """Initial state; ``scale`` is projected onto Θ_L first."""
    ftype = jnp.result_type(float)
    loc = jnp.asarray(loc, ftype)
    scale, scale_inv, logdet = project_scale(scale_type, jnp.asarray(scale, ftype), min_scale)
    return MPSGDState(loc, scale, jnp.asarray(scale_inv, ftype), logdet, loc, scale, jnp.asarray(-jnp.inf, ftype),
                      jnp.zeros((), ftype), jnp.asarray(avg_a, ftype), jnp.asarray(0, jnp.int32), rng_key)


def mc_gradient(potential: Callable, base, scale_type: str, loc, scale, scale_inv, key, num_particles,
                chunk_size: int):
    """Reparameterised estimators of ∇L with the same z for both blocks (specs/mpsgd.md "Estimators"):
    ``g_μ = G1/N``, ``g_Σ = GZᵀ/N − Σ^{-T}`` (tril: ``tril(GZᵀ/N) − diag(1/C_ii)``; diag: ``mean(G∘Z) − 1/s``).

    ``num_particles`` may be traced: the N draws are taken ``chunk_size`` at a time in a ``fori_loop`` (the last
    chunk masked), so growing batches never recompile.  Returns ``(g_μ, g_Σ, mean f(X))``.
    """
    value_and_grad = jax.vmap(jax.value_and_grad(potential), in_axes=(0, None))
    n = jnp.asarray(num_particles, jnp.int32)

    def body(i, acc):
        g_loc, g_scale, f_sum = acc
        z_key, f_key = random.split(random.fold_in(key, i))
        z = base.sample(z_key, (chunk_size,)).astype(loc.dtype)
        valid = (i * chunk_size + jnp.arange(chunk_size)) < n
        f, g = value_and_grad(loc + apply_scale(scale, z, scale_type), f_key)
        g = jnp.where(valid[:, None], g, 0.0)
        g_z = jnp.sum(g * z, 0) if scale_type == "diag" else g.T @ z
        return g_loc + jnp.sum(g, 0), g_scale + g_z, f_sum + jnp.sum(jnp.where(valid, f, 0.0))

    zeros = (jnp.zeros_like(loc), jnp.zeros_like(scale), jnp.zeros((), loc.dtype))
    g_loc, gz, f_sum = lax.fori_loop(0, (n + chunk_size - 1) // chunk_size, body, zeros)
    g_loc, gz = g_loc / n, gz / n
    if scale_type == "full":
        g_scale = gz - scale_inv.T
    elif scale_type == "tril":
        g_scale = jnp.tril(gz) - jnp.diag(1.0 / jnp.diagonal(scale))
    else:
        g_scale = gz - 1.0 / scale
    return g_loc, g_scale, f_sum / n


def make_mpsgd_step(potential: Callable, base, scale_type: str, *, step_size: Callable, num_particles: Callable,
                    chunk_size: int, min_scale: float, lambda_loc: float = 1.0, lambda_scale: float = 1.0,
                    averaging: bool = True) -> Callable:
    """``step(state) -> (state, loss)``: one MPSGD iteration (module docstring).

    :param potential: ``f(x, key)`` (scalar potential energy at an unconstrained point; ``key`` seeds data
        subsampling, shared by the draws of one chunk).
    :param base: standardized base distribution (``sample``, ``entropy()``).
    :param step_size: ``k -> γ_k``; :param num_particles: ``k -> N_k`` (int); drawn ``chunk_size`` at a time.
    :return: the loss is the Monte-Carlo negative ELBO of the iterate before the update,
        ``mean f(X) − log|det Σ| − H(base)``.
    """
    entropy = base.entropy()

    def step(state: MPSGDState):
        k = state.step
        gamma = jnp.asarray(step_size(k), state.loc.dtype)
        n = jnp.maximum(jnp.asarray(num_particles(k), jnp.int32), 1)
        g_loc, g_scale, f_mean = mc_gradient(potential, base, scale_type, state.loc, state.scale, state.scale_inv,
                                             random.fold_in(state.rng_key, k), n, chunk_size)
        loss = f_mean - state.scale_logdet - entropy
        loc = state.loc - gamma * lambda_loc * g_loc
        scale, scale_inv, logdet = project_scale(scale_type, state.scale - gamma * lambda_scale * g_scale, min_scale)
        # iterate average over θ^0..θ^k with weights w_k = γ_k α_{k+1}, α_{k+1} = α_k τ_k (Theorem 7)
        log_tau = -jnp.log1p(state.avg_a * gamma**2 / n)
        log_w = jnp.log(gamma) + state.log_alpha + log_tau
        log_sum = jnp.logaddexp(state.log_weight_sum, log_w)
        r = jnp.exp(log_w - log_sum) if averaging else jnp.asarray(1.0, loc.dtype)
        avg_loc = state.avg_loc + r * (state.loc - state.avg_loc)
        avg_scale = state.avg_scale + r * (state.scale - state.avg_scale)
        new = MPSGDState(loc, scale, jnp.asarray(scale_inv, state.scale_inv.dtype), logdet, avg_loc, avg_scale, log_sum,
                         state.log_alpha + log_tau, state.avg_a, k + 1, state.rng_key)
        return new, loss

    return step


def estimate_smoothness(potential: Callable, x0, *, map_steps: int = 200, power_steps: int = 50,
                        safety: float = 2.0, key=None) -> tuple[float, jax.Array]:
    """``L ≈ safety · λ_max(∇²f(x_MAP))``: L-BFGS to the MAP from ``x0``, then power iteration on
    Hessian-vector products (specs/mpsgd.md "Estimating L": a local lower bound, hence the safety factor).
    Returns ``(L, x_MAP)``."""
    key = random.key(0) if key is None else key
    f = lambda x: potential(x, key)  # noqa: E731

    @jax.jit
    def run(x0):
        x, _ = lbfgs_minimize(f, x0, map_steps)

        def power(v, _):
            hv = jax.jvp(jax.grad(f), (x,), (v,))[1]
            return hv / (jnp.linalg.norm(hv) + 1e-30), None

        v0 = random.normal(random.fold_in(key, 1), x.shape, x.dtype)
        v, _ = lax.scan(power, v0 / jnp.linalg.norm(v0), None, length=power_steps)
        lam = jnp.vdot(v, jax.jvp(jax.grad(f), (x,), (v,))[1])
        return lam, x

    lam, x_map = run(jnp.asarray(x0))
    lam = float(lam)
    if not math.isfinite(lam) or lam <= 0:
        raise ValueError(f"smoothness='auto' found a non-positive curvature {lam} at the MAP; pass smoothness=L.")
    return safety * lam, x_map


def _unit_pair(value) -> bool:
    """Whether ``value`` is a pair of numbers in (0, 1] (the preconditioner's (λ_μ, λ_Σ))."""
    try:
        return len(value) == 2 and all(0 < float(v) <= 1 for v in value)
    except (TypeError, ValueError):  # not a sequence, or not numbers
        return False


def _unconstrained_size(site) -> int:
    """A latent site's coordinates in MPSGD's vector: its unconstrained size (a Dirichlet of K entries has K − 1;
    an enumerated discrete site, summed out, has none)."""
    fn = site["fn"]
    if fn.support.is_discrete:
        return 0
    return int(np.prod(biject_to(fn.support).inverse_shape(fn.shape())))


class MPSGD:
    """Minibatch projected SGD for VI with an :class:`~numpyro_fedvi.guides.AutoLocationScale` guide.

    Two schedules of the same projected step (module docstring):

    * ``schedule="adaptive"`` (default): the step runs in stages of affine whitening (:mod:`numpyro_fedvi.whitening`):
      the frame starts at the init point and its |Hessian|^{-1/2}, then follows the stage averages; in whitened
      coordinates γ = 1/(2L′) with L′ from a free Stein estimate of the expected Hessian, ``num_particles`` defaults to
      ``2·max(d, MIN_RADII)`` spherical–radial draws (unbiased, exact second moments), and ``get_params`` is the
      frame applied to the tail average of the current stage.  No tuning:
      ``MPSGD(model, AutoLocationScale(model)).run(key, 1000, *args)``.
      ``result.diagnostics["stage_moves"]`` says how far the last completed stage moved ``q`` (mean in posterior sd,
      scale change); a run that ends with moves above 0.1 (or before 3 stages) warns that it has not converged.
    * ``schedule="theory"``: the paper's method: γ = 1/(2 L_step), Σ kept in ``Θ_L = {σ_min(Σ) ≥ 1/√L}``, Σ0 = I/√L,
      the τ-weighted average of Theorems 6/7; ``budget=E`` picks ``N`` and ``K`` by Theorem 4 (case i with
      ``preconditioner="identity"``, case ii with ``"theory"``).  The options below marked (theory) belong to it.

    :param schedule: ``"adaptive"`` or ``"theory"``.
    :param num_particles: N (even with spherical draws) — adaptive default ``2·max(d, 4)``; theory default 1, an
        int or a schedule ``k -> N_k`` drawn ``chunk_size`` at a time (a schedule giving N_k < 1 at any step of a run is
        refused before the run compiles).
    :param draws: ``"spherical"`` (adaptive default) or ``"iid"`` (theory default, the paper's estimator).
    :param stage_length: (adaptive) length of the first stage (stages double).
    :param init_scale: initial Σ = init_scale·I (theory default 1/√L; adaptive: the first frame's scale, replacing the
        Hessian-based frame, and q's: it starts at exactly init_scale·I).
    :param step_size: (theory) ``None`` = 1/(2 L_step), a float, or a schedule ``k -> γ_k`` (a float above
        ``THEORY_STEP_WARN / L`` = 10⁴/L is warned about).
    :param smoothness: (theory) L of the potential (float) or ``"auto"`` (default: :func:`estimate_smoothness` at the
        MAP with safety factor 2, once per engine and input shapes).  Used for the step size and, unless
        ``projection_smoothness`` is given, for the projection threshold 1/√L.
    :param projection_smoothness: (theory) a separate L for the projection.
    :param step_schedule: (theory) ``None`` (constant γ) or a dynamic-batching strategy ``"S1"``, ``"S2"``, ``"S3"``
        of Theorem 7 built from γ and ``num_particles`` (:func:`numpyro_fedvi.schedules.dynamic_batching`).
    :param preconditioner: (theory) ``"theory"`` (default: λ_μ = 1, λ_Σ = 1/(2(d−1+κ)), Theorem 4 ii),
        ``"identity"``, or a tuple ``(λ_μ, λ_Σ)`` in (0, 1]².
    :param averaging: theory: ``"tau"`` (default; weighted average of Theorems 6/7) or ``"none"``; adaptive:
        ``"tail"`` (default; the second half of the current stage) or ``"none"`` (the last iterate).
    :param averaging_a: (theory) the constant ``a ≥ 0`` in τ_k = 1/(1 + aγ_k²/N_k).  Default: with ``budget=E``,
        Theorem 4's ``a = N/(γ²K)``; otherwise ``a = 0``, the γ-weighted uniform average.  ``a`` never depends on
        the ``num_steps`` of a ``run`` call, so a resumed run is bitwise equal to an uninterrupted one.
    :param budget: (theory) gradient budget E (Theorem 4); ``run(rng_key, None, ...)`` then runs K steps.
    :param chunk_size: (theory) draws per inner chunk of the gradient estimator (default N for a constant N).

    Data subsampling: a model with a subsampled plate (``plate("data", N, subsample_size=B)``) runs unchanged.
    The potential ``f`` is then NumPyro's minibatch estimate (the plate's N/B scaling), so the gradient stays
    unbiased (more noise, O(B) per draw); adaptive: one minibatch per ± pair of draws (the pairs average the
    minibatch noise, which cancels within a pair from the scale gradient) and a step lowered stage by stage until
    the iterates' spread is small (:func:`~numpyro_fedvi.whitening.stage_step_size`); theory: one minibatch per
    chunk of draws.
    ``evaluate`` likewise estimates the NegELBO on a minibatch.  The paper's theory covers the Monte-Carlo-only
    case.  Local latents inside a subsampled plate are not supported by ``AutoLocationScale``.

    Inputs (``*args, **kwargs`` of ``init/update/evaluate/run``) may be JAX/NumPy arrays, lists or pandas
    objects; NaN/inf raise a ``ValueError`` naming the argument before anything compiles.  ``update``,
    ``stable_update``, ``evaluate`` and the run loop are compiled once per input shapes and kept by the engine.
    """

    _THEORY_ONLY = ("step_size", "smoothness", "projection_smoothness", "step_schedule", "preconditioner",
                    "averaging_a", "budget", "chunk_size")

    _input_arrays: dict | None = None   # array_arguments of init's model inputs (check_inputs_like)

    def __init__(self, model, guide, *extra, schedule: str = "adaptive", num_particles: int | Callable | None = None,
                 draws: str | None = None, stage_length: int = 25, init_scale: float | None = None,
                 averaging: str | None = None, step_size: float | Callable | None = None,
                 smoothness: float | str | None = None, projection_smoothness: float | None = None,
                 step_schedule: str | None = None, preconditioner: str | tuple | None = None,
                 averaging_a: float | None = None, budget: int | None = None, chunk_size: int | None = None,
                 **static_kwargs):
        from .guides import AutoLocationScale

        if extra:   # numpyro.infer.SVI's (model, guide, optim, loss)
            raise TypeError("MPSGD(model, guide, *, ...) takes no optimizer and no loss (it sets its own steps and "
                            "estimates the ELBO itself: num_particles=, draws=); the options are keyword arguments.")
        check_guide_built(guide, "MPSGD")
        if not isinstance(guide, AutoLocationScale):
            raise TypeError("MPSGD needs a numpyro_fedvi.AutoLocationScale guide (raw location-scale params kept "
                            f"feasible by projection); got {type(guide).__name__}. Use nfv.AutoLocationScale(model) "
                            "(a full-rank Gaussian, as AutoMultivariateNormal) or nfv.AutoLocationScale(model, "
                            "scale='diag') (mean-field, as AutoNormal).")
        if schedule not in ("adaptive", "theory"):
            raise ValueError(f"schedule must be 'adaptive' or 'theory', got {schedule!r}.")
        given = {k: v for k, v in dict(step_size=step_size, smoothness=smoothness,
                                       projection_smoothness=projection_smoothness, step_schedule=step_schedule,
                                       preconditioner=preconditioner, averaging_a=averaging_a, budget=budget,
                                       chunk_size=chunk_size).items() if v is not None}
        if schedule == "adaptive" and given:
            raise ValueError(f"{sorted(given)} are options of schedule='theory' (the paper's step sizes); the adaptive "
                             "schedule sets its steps from the whitened curvature. Pass schedule='theory' to use them.")
        smoothness = "auto" if smoothness is None else smoothness
        preconditioner = "theory" if preconditioner is None else preconditioner
        averaging = averaging or ("tail" if schedule == "adaptive" else "tau")
        draws = draws or ("spherical" if schedule == "adaptive" else "iid")
        if isinstance(smoothness, str):
            if smoothness != "auto":
                raise ValueError(f"smoothness must be a positive finite float or 'auto', got {smoothness!r}.")
        else:
            smoothness = check_positive(smoothness, "smoothness", expected="a positive finite float or 'auto'")
        if projection_smoothness is not None:
            projection_smoothness = check_positive(projection_smoothness, "projection_smoothness")
        if step_schedule not in (None, "constant", "S1", "S2", "S3"):
            raise ValueError(f"step_schedule must be None, 'S1', 'S2' or 'S3', got {step_schedule!r}.")
        allowed = ("tail", "none") if schedule == "adaptive" else ("tau", "none")
        if averaging not in allowed:
            raise ValueError(f"averaging must be one of {allowed} with schedule={schedule!r}, got {averaging!r}.")
        if draws not in ("spherical", "iid") or (schedule == "theory" and draws != "iid"):
            raise ValueError(f"draws must be 'spherical' or 'iid' (schedule='theory': 'iid'), got {draws!r}.")
        if averaging_a is not None and not (is_real_number(averaging_a) and math.isfinite(averaging_a)
                                            and averaging_a >= 0):
            raise ValueError(f"averaging_a must be a finite float >= 0, got {averaging_a!r}.")
        if isinstance(preconditioner, str):
            if preconditioner not in ("theory", "identity"):
                raise ValueError(f"preconditioner must be 'theory', 'identity' or (λ_μ, λ_Σ); got {preconditioner!r}.")
        elif not _unit_pair(preconditioner):
            raise ValueError(f"preconditioner must be 'theory', 'identity' or a pair (λ_μ, λ_Σ) in (0, 1]², got "
                             f"{preconditioner!r}.")
        if isinstance(num_particles, (int, np.integer)) and not isinstance(num_particles, bool):
            if num_particles < 1:
                raise ValueError(f"num_particles must be >= 1, got {num_particles}.")
            if draws == "spherical" and num_particles % 2:
                raise ValueError(f"spherical draws come in ± pairs: num_particles must be even, got {num_particles}.")
        elif num_particles is not None and (schedule == "adaptive" or not callable(num_particles)):
            raise ValueError("num_particles must be a positive int" + (" (or a schedule k -> N_k with "
                             "schedule='theory')" if schedule == "adaptive" else " or a schedule k -> N_k") +
                             f", got {num_particles!r}.")
        if isinstance(stage_length, bool) or not isinstance(stage_length, (int, np.integer)) or stage_length < 2:
            raise ValueError(f"stage_length must be an integer >= 2, got {stage_length!r}.")
        if budget is not None and (not isinstance(budget, (int, np.integer)) or budget < 1):
            raise ValueError(f"budget must be a positive integer number of gradient evaluations, got {budget!r}.")
        if step_size is not None and not callable(step_size):
            step_size = check_positive(step_size, "step_size",
                                       expected="None, a positive finite float or a schedule k -> γ_k")
        if init_scale is not None and not (is_real_number(init_scale) and math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"init_scale must be a positive finite float, got {init_scale!r}.")
        self.model, self.guide, self.schedule, self.draws = model, guide, schedule, draws
        self.stage_length = int(stage_length)
        self.step_size, self.smoothness, self.projection_smoothness = step_size, smoothness, projection_smoothness
        self.num_particles, self.step_schedule, self.preconditioner = num_particles, step_schedule, preconditioner
        self.averaging, self.averaging_a, self.budget = averaging, averaging_a, budget
        check_static_kwargs(static_kwargs, model, "MPSGD")
        self.init_scale, self.chunk_size, self.static_kwargs = init_scale, chunk_size, static_kwargs
        self._setup_done = False

    @property
    def adaptive(self) -> bool:
        return self.schedule == "adaptive"

    # setup ------------------------------------------------------------------------------------------
    def _potential(self, args, kwargs):
        """``f(x, key)``: the model's potential energy at the guide's unconstrained point ``x`` (``key`` seeds the
        model's own draws, e.g. its plate's minibatch), with the enumerated discrete sites that the guide does not
        sample summed out (:mod:`~numpyro_fedvi.enumeration`, found at set-up)."""
        kwargs = {**kwargs, **self.static_kwargs}
        info, imputed = self._enum
        energy = potential_fn(info)
        # obs_mask's entries at observed rows: a standard density (the joint latent cannot leave them out)
        model = without_imputed_entries(self.model, self.guide, imputed, True)[0]

        def potential(x, key):
            return energy(handlers.seed(model, key), args, kwargs, self.guide._unpack_latent(x))

        return potential

    @staticmethod
    def _shapes_key(args, kwargs, *extra):
        arrays, static = split_inputs((args, kwargs))
        return (static, tuple((a.shape, str(a.dtype)) for a in arrays), *extra)

    def _smoothness(self, rng_key, args, kwargs, init_loc) -> float:
        """``smoothness="auto"``: estimated once per data (their values, not only their shapes: a run on new data of
        the same shapes kept the first data's L, 193 for 1735, and diverged), then cached on the engine."""
        if self.smoothness != "auto":
            return float(self.smoothness)
        digest = hashlib.sha1()
        for a in split_inputs((args, kwargs))[0]:
            digest.update(np.ascontiguousarray(np.asarray(a)).tobytes())
        key = self._shapes_key(args, kwargs, tuple(init_loc.shape), digest.hexdigest())
        cache = self.__dict__.setdefault("_smoothness_cache", {})
        if key not in cache:
            cache[key], _ = estimate_smoothness(self._potential(args, kwargs), init_loc, key=rng_key)
        return cache[key]

    def _enum_info(self, args, kwargs):
        """``(EnumInfo, imputation sites)``: the model's enumerated sites that the guide does not sample
        (:mod:`~numpyro_fedvi.enumeration`) and its ``obs_mask`` imputation sites
        (:func:`~numpyro_fedvi.structure.imputation_sites`), from one abstract trace per input shapes at the guide's
        initial point (constrained: an ``ImproperUniform`` latent has no sampler), cached on the engine.  A guide
        whose latent vector is not the model's latents (built for another model: a latent it lacks was drawn from its
        prior at every step, one it has only entered the entropy) is refused there."""
        key = self._shapes_key(args, kwargs)
        cache = self.__dict__.setdefault("_enum_cache", {})
        if key not in cache:
            proto, unc = self.guide.prototype_trace, self.guide._unpack_latent(self._init_loc)
            init = {n: biject_to(proto[n]["fn"].support)(v) for n, v in unc.items()}
            info, latent, imputed, params = read_abstract_trace(
                self.model, args, {**kwargs, **self.static_kwargs},
                lambda tr: (enum_info_of_trace(tr, init), {n for n, site in tr.items() if site["type"] == "sample"
                                                           and not site["is_observed"]}, imputation_sites(tr),
                            sorted(n for n, site in tr.items() if site["type"] == "param")), init)
            if params:
                raise ValueError(
                    f"MPSGD: the model declares numpyro.param site(s) {params}; MPSGD fits the guide's location and "
                    "scale only (its projected steps have no place for a model param), so they would stay at their "
                    "initial values. Give each a prior (numpyro.sample) or a fixed value (a model argument), or fit "
                    "them with an engine that learns model params as SVI does (PDVI, FedSVI, FedLocalVI).")
            missing, extra = sorted(latent - set(init) - set(info.names)), sorted(set(init) - latent)
            left_out = arguments_left_out(self.model, args, kwargs, sorted(latent))
            if left_out:
                raise TypeError(f"MPSGD: the model's argument(s) {left_out} got no value (None), so the model samples "
                                f"the site(s) {left_out} it observes: pass the observations, as for SVI, e.g. "
                                f"run(key, num_steps, ..., {left_out[0]}={left_out[0]}).")
            if missing or extra:
                raise ValueError(
                    "the guide's latent vector does not cover this model's latents (a guide built for another "
                    f"model?): {f'model sites not in the guide: {missing}' if missing else ''}"
                    f"{'; ' if missing and extra else ''}{f'guide sites not in the model: {extra}' if extra else ''}. "
                    "Build it on the model the engine runs: MPSGD(model, AutoLocationScale(model)); a discrete latent "
                    "is summed out when marked infer={'enumerate': 'parallel'}.")
            cache[key] = info, imputed
        return cache[key]

    def _warn_per_datum_latents(self):
        """Per-datum latents (sites in the plate around every observation) all go into MPSGD's one latent vector:
        d grows with N and the scale with d² (``"full"``); warned about from ``PER_DATUM_WARN_DIM`` coordinates."""
        tr = getattr(self.guide, "prototype_trace", None) or {}
        data_plates = set(observation_plates(tr))
        if not data_plates:
            return
        sites = {name: _unconstrained_size(s) for name, s in tr.items() if s["type"] == "sample"
                 and not s["is_observed"] and data_plates & {f.name for f in s["cond_indep_stack"]}}
        local = sum(sites.values())
        imputed = [name for name in imputation_sites(tr) if name in sites]
        # obs_mask=: one imputed coordinate per entry of y, observed or not (only the missing ones enter the model)
        masked = (f" ({sum(sites[k] for k in imputed)} of them numpyro's obs_mask= imputations {imputed}: one per "
                  "entry of the observation, missing or not; the same model with the observation under "
                  "numpyro.handlers.mask(mask=observed) instead, the missing entries filled with any finite value, "
                  "has none of them and the same posterior for the other latents)" if imputed else "")
        if local >= PER_DATUM_WARN_DIM:
            cost = ("a random d×d rotation, O(d³): 0.02 / 0.09 / 0.8 s per step at d = 500 / 1,000 / 2,000 on one "
                    "core, whatever the scale type" if self.adaptive and self.draws == "spherical" else "")
            n = self.num_particles
            draws = (n if isinstance(n, (int, np.integer)) else "N_k") if n else (
                2 * max(self.dim, MIN_RADII) if self.adaptive else 1)
            warn(f"MPSGD: {local} of the d = {self.dim} latent coordinates are per-datum (sites in the plate "
                 f"{sorted(data_plates)} of the observations){masked}; MPSGD optimises them in one vector, so d and "
                 f"the cost of a step grow with N: {draws} gradient evaluations of the whole model per step"
                 f"{', ' + cost if cost else ''}{', and a d×d scale' if self.scale_type != 'diag' else ''}. "
                 "PDVI is made for per-datum latents.", UserWarning)

    def _setup(self, rng_key, args, kwargs):
        self._input_arrays = array_arguments(args, kwargs, self.model)  # for check_inputs_like
        with handlers.trace() as tr, handlers.seed(rng_seed=rng_key):
            self.guide(*args, **kwargs, **self.static_kwargs)
        guide = self.guide
        self.dim, self.scale_type, self.base = guide.latent_dim, guide.scale_type, guide.base
        self.kurtosis = float(self.base.kurtosis)
        self._init_loc = tr[guide.loc_name]["value"]
        self._warn_per_datum_latents()
        prototype = getattr(guide, "prototype_trace", None)
        if prototype is not None:
            warn_dependent_supports(self.model, prototype, args, {**kwargs, **self.static_kwargs}, "MPSGD", rng_key)
        self._enum = self._enum_info(args, kwargs)
        self.default_num_steps = None
        if self.adaptive:
            self._num_particles = int(self.num_particles or 2 * max(self.dim, MIN_RADII))
            self.L = self.L_proj = None
            self._setup_done = True
            return
        init_loc = self._init_loc
        self.L = self._smoothness(rng_key, args, kwargs, init_loc)
        self.L_proj = float(self.projection_smoothness or self.L)
        if isinstance(self.preconditioner, str):
            lam = (1.0, 1.0) if self.preconditioner == "identity" else \
                (1.0, 1.0 / (2.0 * (self.dim - 1 + self.kurtosis)))
        else:
            lam = tuple(float(v) for v in self.preconditioner)
        self.lambda_loc, self.lambda_scale = lam
        num_particles = 1 if self.num_particles is None else self.num_particles
        n_const = num_particles if isinstance(num_particles, (int, np.integer)) else None
        if self.budget is not None:
            case = "i" if self.preconditioner == "identity" else "ii"
            plan = theorem4(int(self.budget), self.dim, self.kurtosis, case)
            n_const, self.default_num_steps = plan.num_particles, plan.num_steps
        gamma0 = 1.0 / (2.0 * self.L) if self.step_size is None else self.step_size
        if self.step_schedule in ("S1", "S2", "S3"):
            if callable(gamma0) or n_const is None:
                raise ValueError("step_schedule='S1'|'S2'|'S3' builds the schedules from a float step_size (or the "
                                 "theory default) and an int num_particles.")
            self._gamma, self._batch = dynamic_batching(self.step_schedule, gamma0, n_const)
        else:
            self._gamma = gamma0 if callable(gamma0) else constant(gamma0)
            self._batch = batch_growth(n_const, 0.0) if n_const is not None else num_particles
        n0 = int(self._batch(0))
        if n0 < 1:
            raise ValueError(f"num_particles must give N_k >= 1 draws per step; the schedule gives N_0 = {n0}.")
        if self.step_size is not None and not callable(self.step_size) and self.step_size * self.L > THEORY_STEP_WARN:
            warn(f"step_size={self.step_size:.3g} is {2 * self.step_size * self.L:.3g} times the theory step "
                 f"1/(2L) = {0.5 / self.L:.3g} (L = {self.L:.3g}); such a step diverges or gives a "
                 "meaningless q. Lower it, or leave step_size=None.", UserWarning)
        self._chunk = int(self.chunk_size or (n0 if n_const is not None and self.step_schedule in (None, "constant")
                                              else min(max(n0, 8), 256)))
        self._min_scale = 1.0 / math.sqrt(self.L_proj)
        self._setup_done = True

    def _avg_a(self) -> float:
        """The averaging constant a (a property of the engine's settings, never of a run's length)."""
        if self.averaging_a is not None:
            return float(self.averaging_a)
        if self.default_num_steps is not None:  # budget=E: Theorem 4's τ = K/(K+1) for its K
            gamma0, n0 = float(self._gamma(0)), float(self._batch(0))
            return n0 / (gamma0**2 * self.default_num_steps)
        return 0.0

    def _config(self):
        """What the compiled step bakes in (besides the inputs' shapes): its cache key."""
        if self.adaptive:
            return ("adaptive", self._num_particles, self.draws, self.dim)
        return (self.L, self.L_proj, self.lambda_loc, self.lambda_scale, self._chunk, self.dim)

    def _compiled(self, name, fn):
        """``fn(state, inputs)`` jitted once per engine settings and input shapes (see :class:`InputJit`)."""
        cache = self.__dict__.setdefault("_jit_cache", {})
        key = (name, self._config())
        if key not in cache:
            cache[key] = InputJit(fn)
        return cache[key]

    def _check_batches(self, step0: int, num_steps: int):
        """The batch sizes ``N_k`` of steps ``step0 .. step0 + num_steps - 1`` (host array; theory schedule), refused
        (``ValueError``) when one is below 1: a schedule ``k -> N_k`` that gives 0 would run steps without draws."""
        if self.adaptive:
            return np.full(num_steps, self._num_particles)
        ks = step0 + np.arange(num_steps)
        batches = np.broadcast_to(np.asarray(jax.vmap(self._batch)(jnp.asarray(ks, jnp.int32))), ks.shape)
        bad = np.flatnonzero(batches < 1)
        if bad.size:
            raise ValueError(f"num_particles must give N_k >= 1 draws per step; the schedule gives N_k = "
                             f"{int(batches[bad[0]])} at step k = {int(ks[bad[0]])} ({bad.size} of the {num_steps} "
                             "steps of this run).")
        return batches

    def _batch_size(self, k):
        return self._num_particles if self.adaptive else self._batch(k)

    # SVI surface ------------------------------------------------------------------------------------
    @concrete_data_fallback
    def init(self, rng_key, *args, init_params: dict | None = None, **kwargs) -> MPSGDState | WhitenedState:
        """Set up guide and schedules; the initial state.  Theory: μ0 from the guide's init_loc_fn, Σ0 = I/√L (or
        ``init_scale``).  Adaptive: the first frame at μ0, its |Hessian|^{-1/2} with q's scale 1/√2 of it (the
        paper's Σ0 = I/√L, whitened), or ``init_scale`` / the given scale, where q starts exactly (as ``SVI.init``
        with ``init_params``)."""
        args, kwargs = prepare_inputs(args, kwargs, self.model)
        setup_key, rng_key = random.split(as_typed_key(rng_key))
        self._setup(setup_key, args, kwargs)
        loc, scale = self._init_loc, None
        if self.init_scale is not None:
            scale = float(self.init_scale) * (jnp.ones(self.dim) if self.scale_type == "diag" else jnp.eye(self.dim))
        if init_params:
            unknown = set(init_params) - {self.guide.loc_name, self.guide.scale_name}
            if unknown:
                raise ValueError(f"init_params names unknown params {sorted(unknown)}; use "
                                 f"{self.guide.loc_name!r} and {self.guide.scale_name!r}.")
            loc = init_params.get(self.guide.loc_name, loc)
            scale = init_params.get(self.guide.scale_name, scale)
            shapes = dict(zip((self.guide.loc_name, self.guide.scale_name), self._param_shapes()))
            for name, value in init_params.items():
                if tuple(jnp.shape(value)) != shapes[name]:
                    raise ValueError(f"init_params[{name!r}] has shape {tuple(jnp.shape(value))}; this guide's is "
                                     f"{shapes[name]} (d = {self.dim} latent coordinates, scale={self.scale_type!r}).")
        if self.adaptive:
            return self._compiled("init", self._whitened_init)((loc, scale, rng_key), (args, kwargs))
        if scale is None:
            scale = self._min_scale * (jnp.ones(self.dim) if self.scale_type == "diag" else jnp.eye(self.dim))
        return mpsgd_init(loc, scale, self.scale_type, self._min_scale, rng_key, self._avg_a())

    def _whitened_init(self, start, inputs):
        loc, scale, rng_key = start
        args, kwargs = inputs
        return whitened_init(self._potential(args, kwargs), loc, self.scale_type, rng_key, frame_scale=scale,
                             stage_length=self.stage_length)

    def _require_init(self):
        if not self._setup_done:
            raise RuntimeError("Call MPSGD.init(rng_key, *args, **kwargs) (or run) before update/evaluate.")

    def _step(self, state, inputs):
        """``(state, loss)`` of one iteration; ``inputs = (args, kwargs)`` (traced by the run loop)."""
        args, kwargs = inputs
        if self.adaptive:
            return make_whitened_step(self._potential(args, kwargs), self.base, self.scale_type, self._num_particles,
                                      self.draws)(state)
        step = make_mpsgd_step(self._potential(args, kwargs), self.base, self.scale_type, step_size=self._gamma,
                               num_particles=self._batch, chunk_size=self._chunk, lambda_loc=self.lambda_loc,
                               lambda_scale=self.lambda_scale, min_scale=self._min_scale,
                               averaging=self.averaging == "tau")
        return step(state)

    def _stable_step(self, state, inputs):
        new_state, loss = self._step(state, inputs)
        return revert_non_finite(new_state, state, jnp.isfinite(loss) & tree_all_finite(new_state)), loss

    def _prepared(self, args, kwargs):
        """The model's inputs of a call after ``init``: converted (:func:`prepare_inputs`), every array init had."""
        args, kwargs = prepare_inputs(args, kwargs, self.model)
        check_inputs_like(self._input_arrays, args, kwargs, "MPSGD", self.model)
        return args, kwargs

    @concrete_data_fallback
    def update(self, state, *args, **kwargs):
        """One MPSGD iteration (compiled once per input shapes); the loss is the Monte-Carlo negative ELBO at the
        iterate before the update."""
        self._require_init()
        args, kwargs = self._prepared(args, kwargs)
        with shapes_noted(self._input_arrays, args, kwargs, "MPSGD", self.model):
            return self._compiled("update", self._step)(self._checked(state), (args, kwargs))

    def _param_shapes(self) -> tuple:
        """The shapes of (μ, Σ): (d,) and (d,) for a diag scale, (d, d) otherwise."""
        return (self.dim,), (self.dim,) if self.scale_type == "diag" else (self.dim, self.dim)

    def _checked(self, state):
        """``state`` if it is one of this engine's (its schedule's state type, the guide's loc / scale shapes): a
        state of another engine or guide ran on silently (a full scale in a diag engine) or failed deep inside."""
        want = WhitenedState if self.adaptive else MPSGDState
        shapes = dict(zip(("loc", "scale"), self._param_shapes()))
        got = {k: tuple(jnp.shape(getattr(state, k, ()))) for k in shapes}
        if not isinstance(state, want) or got != shapes:
            raise ValueError(
                f"this state is not one of this engine's: a {type(state).__name__} with loc / scale shapes "
                f"{tuple(got.values())}, where this MPSGD (schedule={'adaptive' if self.adaptive else 'theory'!r}, "
                f"scale={self.scale_type!r}, d = {self.dim}) runs on a {want.__name__} with shapes "
                f"{tuple(shapes.values())}. Resume on an engine built as the one that wrote the state.")
        for k in shapes:  # (a float32 state under enable_x64 ran on silently in float32)
            check_state_precision(f"state.{k}", getattr(state, k), self._init_loc, "MPSGD")
        return state

    @concrete_data_fallback
    def stable_update(self, state, *args, **kwargs):
        """Like ``update`` but keeps the old state when the loss or the new state is not finite."""
        self._require_init()
        args, kwargs = self._prepared(args, kwargs)
        with shapes_noted(self._input_arrays, args, kwargs, "MPSGD", self.model):
            return self._compiled("stable_update", self._stable_step)(self._checked(state), (args, kwargs))

    @concrete_data_fallback
    def evaluate(self, state, *args, num_samples: int = 100, rng_key=None, which: str | None = None,
                 **kwargs) -> jax.Array:
        """Negative ELBO with ``num_samples`` fixed draws (common random numbers: the same ``rng_key``, default
        ``random.key(0)``, gives the same z for every state), at the average or the last iterate."""
        self._require_init()
        state = self._checked(state)
        self._pick(state, which)  # validates `which` before compiling
        if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) or num_samples < 1:
            raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}.")
        args, kwargs = self._prepared(args, kwargs)
        key = random.key(0) if rng_key is None else as_typed_key(rng_key)
        with shapes_noted(self._input_arrays, args, kwargs, "MPSGD", self.model):
            return self._compiled("evaluate", self._evaluate)(state, (key, int(num_samples), which, args, kwargs))

    def _evaluate(self, state, inputs):
        key, num_samples, which, args, kwargs = inputs
        loc, scale = self._pick(state, which)
        z = self.base.sample(key, (num_samples,)).astype(loc.dtype)
        f = jax.vmap(self._potential(args, kwargs), in_axes=(0, None))(loc + apply_scale(scale, z, self.scale_type),
                                                                       random.fold_in(key, 1))
        return jnp.mean(f) - log_abs_det_scale(scale, self.scale_type) - self.base.entropy()

    def _pick(self, state, which):
        default = "last" if self.averaging == "none" else "average"
        which = which or default
        if which not in ("average", "last"):
            raise ValueError(f"which must be 'average' or 'last', got {which!r}.")
        if self.adaptive:
            return whitened_params(state, self.scale_type, last=which == "last")
        return (state.avg_loc, state.avg_scale) if which == "average" else (state.loc, state.scale)

    def get_params(self, state, which: str | None = None) -> dict[str, jax.Array]:
        """Guide params ``{loc_name: μ, scale_name: Σ}`` of the averaged iterate (theory: the τ-average; adaptive:
        the frame applied to the current stage's tail average) or the last one (``which="last"``); usable with
        ``Predictive(guide, params=...)``."""
        self._require_init()
        loc, scale = self._pick(state, which)
        return {self.guide.loc_name: loc, self.guide.scale_name: scale}

    @concrete_data_fallback
    def run(self, rng_key, num_steps: int | None, *args, progress_bar: bool = True, stable_update: bool = False,
            init_state=None, init_params: dict | None = None, callbacks=(),
            early_stopping: EarlyStopping | None = None, chunk_size: int | None = None, **kwargs) -> RunResult:
        """Run ``num_steps`` iterations (``None`` with ``budget=E``: Theorem 4's K) in the shared compiled loop.

        ``init_state`` resumes a previous run (same model args): the result is bitwise equal to one uninterrupted
        run of the total length (the averaged iterate included).  The compiled loop is kept by the engine, so a
        second run on inputs of the same shapes does not recompile.  ``result.params`` is the averaged iterate;
        ``result.diagnostics["last_params"]`` the last one, plus ``num_particles`` (N_0), ``gradient_evaluations``
        (of this call) and, theory: ``L``, ``L_proj``, ``lambda``, ``drift``, ``drift_site``, ``converged``
        (:meth:`check_convergence`); adaptive: ``L`` and ``step_size`` (whitened, of the
        current stage), ``iterate_spread`` (the last tail's largest detrended whitened iterate variance, behind that
        step), ``stage_moves``, ``stages_completed``, ``converged``.
        """
        if num_steps is None:
            if self.budget is None:
                raise ValueError("num_steps=None needs budget=E (Theorem 4 then fixes K).")
        elif isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)) or num_steps < 1:
            raise ValueError(f"num_steps must be a positive integer, got {num_steps!r}.")
        rng_key = as_typed_key(rng_key)
        args, kwargs = prepare_inputs(args, kwargs, self.model)
        before = self._input_arrays  # the shapes of the last set-up: named in an error at other shapes
        if init_state is None:
            state = self.init(rng_key, *args, init_params=init_params, **kwargs)
        else:
            check_inputs_like(self._input_arrays, args, kwargs, "MPSGD", self.model)
            with shapes_noted(before, args, kwargs, "MPSGD", self.model):
                self._setup(random.split(rng_key)[0], args, kwargs)  # cheap after the first run: L is cached
            state = self._checked(init_state)
        num_steps = num_steps or self.default_num_steps
        done = int(state.step)
        batches = self._check_batches(done, num_steps)
        # theory: the output's snapshots over the run's last quarter (the adaptive schedule judges its stages)
        hooks, snapshots = ([], None) if self.adaptive else quarter_snapshots(num_steps, self._output_snapshot, done)
        with shapes_noted(before, args, kwargs, "MPSGD", self.model):
            result = run_loop(self._step, state, num_steps, inputs=(args, kwargs), get_params=self.get_params,
                              progress_bar=progress_bar, callbacks=callbacks, early_stopping=early_stopping,
                              stable_update=stable_update, chunk_size=chunk_size, desc=type(self).__name__,
                              cache=self.__dict__.setdefault("_run_cache", {}).setdefault(self._config(), {}),
                              hooks=hooks)
        steps_run = result.diagnostics["num_steps"]
        grads = int(np.sum(batches[:steps_run]))
        result.diagnostics.update(last_params=self.get_params(result.state, "last"),
                                  num_particles=int(self._batch_size(0)), gradient_evaluations=grads)
        if self.adaptive:
            moves = np.asarray(result.state.stage_moves)
            stages = int(result.state.stages_completed)
            converged = bool(stages >= MIN_STAGES and np.all(moves <= CONVERGED_MOVE))
            result.diagnostics.update(L=float(result.state.smoothness), step_size=float(result.state.step_size),
                                      iterate_spread=float(result.state.spread), stage_moves=moves.tolist(),
                                      stages_completed=stages, converged=converged)
            reason = result.diagnostics["stop_reason"]
            if not converged and reason in ("completed", "early_stopping"):
                moved = (f"the last stage moved the mean by {against(moves[0], CONVERGED_MOVE)} posterior sd and "
                         f"the scale by {against(moves[1], CONVERGED_MOVE)}" if stages else "no stage has ended yet")
                early = (" (EarlyStopping stopped it: the loss is a noisy Monte-Carlo estimate, a relative rule "
                         "can fire long before the stages settle)" if reason == "early_stopping" else "")
                warn(
                    f"MPSGD has not converged after {int(result.state.step)} steps{early}: {moved} ({stages} stages "
                    f"completed; converged means >= {MIN_STAGES} stages, the last moving the mean and the scale by "
                    f"<= {CONVERGED_MOVE}). Continue with run(key, num_steps, ..., init_state=result.state)."
                    f"{far_start_advice(moves[0]) if stages else ''}", RuntimeWarning)
        else:
            result.diagnostics.update(L=self.L, L_proj=self.L_proj, **{"lambda": (self.lambda_loc, self.lambda_scale)})
            self.check_convergence(result, snapshots(result.state), done)
        return result

    def _output_snapshot(self, state) -> dict:
        """The output q (``get_params``'s iterate) as the theory schedule's convergence check reads it: its location
        and the log of its scale per coordinate (the norm of Σ's row: q's scale along that coordinate)."""
        loc, scale = self._pick(state, None)
        row = jnp.abs(scale) if self.scale_type == "diag" else jnp.linalg.norm(scale, axis=-1)
        return {self.guide.loc_name: loc, self.guide.scale_name: jnp.log(row)}

    def check_convergence(self, result: RunResult, snapshots: list, done: int = 0) -> None:
        """``schedule="theory"``: :func:`~numpyro_fedvi.runner.check_quarter_move` of the output's snapshots
        (:meth:`_output_snapshot`) over the run's last quarter — the location in units of q's own scale, the log-scale
        as it is (0.1: a 10% change) — so a run whose τ-average is still travelling, most often q's scale growing from
        its small start Σ0 = I/√L, says so (``diagnostics["drift"]``, ``["converged"]``, a warning)."""
        def units(newest):
            scale = np.exp(np.asarray(newest[self.guide.scale_name], np.float64))
            return {self.guide.loc_name: 1.0 / scale ** 2, self.guide.scale_name: np.ones_like(scale)}

        check_quarter_move(result, snapshots, units, "MPSGD", "q's own scale; its log-scale as it is",
                           int(result.state.step), done=done, steps="steps")


def far_start_advice(mean_move: float) -> str:
    """What a non-converged run is advised when its last stage moved q's mean by more than ``FAR_MOVE`` posterior sd:
    a step moves the whitened mean by at most ``TRUST_LOC`` (one posterior sd of the frame), so a start where the
    loss's curvature is extreme (a far start's sd can be 1e-7) travels for ever; else ""."""
    if not mean_move > FAR_MOVE:
        return ""
    return (f" q's mean is still travelling ({mean_move:.3g} posterior sd in the last stage): the run started far from "
            "the optimum, where a step moves it at most one posterior sd of the curvature there; start the guide "
            "nearer: AutoLocationScale(model, init_loc_fn=init_to_value(values={...})) at values you expect near the "
            "posterior (the default init_to_median starts at the prior's median), or pass init_params= from a short "
            "SVI run.")
