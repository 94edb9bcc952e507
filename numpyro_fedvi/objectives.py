"""Objectives built from the user's own NumPyro ELBO object (never hand-written per model).

``block_loss`` is the negative ELBO of one fixed block ``b`` of the data plate (PD-VI, specs/pdvi.md §2; a client of
the federated engines is the same thing: a block of the same model's data plate):

    f_b(φ_b, λ) = Σ_{i∈b} [local terms of datum i]  +  (|b|/N) · [global terms]

so that ``Σ_b f_b`` is the full-data negative ELBO.  With a subsampled data plate the block's indices are pinned
on the plate of both model and guide (``substitute``), padded entries are masked out, NumPyro's ``N/|b|``
subsample scale is undone for sites inside the data plate, global sites are weighted ``|b|/N``, and the local
params are passed as just the block's rows (no O(N) scatter per evaluation).  With an unsubsampled plate the same
weights are applied through a mask on the full plate (O(N)).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpyro.distributions as dist
from numpyro import handlers
from numpyro.infer import RenyiELBO, Trace_ELBO, init_to_uniform
from numpyro.primitives import Messenger

from .structure import ModelStructure, Partitions

__all__ = ["block_loss_fn", "check_elbo", "client_loss_fn", "client_loss_from_blocks", "elbo_loss", "full_loss_fn",
           "without_imputed_entries"]


def check_elbo(loss, engine: str, clients: bool = False, extra: tuple = ()):
    """``loss`` must be None or a NumPyro ELBO whose full-data loss is a SUM over the data: every engine here splits
    it over blocks or clients of the data plate (and PD-VI's oracle averages it over particles).  Rényi's α-bound
    is a log-mean-exp over particles of the whole data's weight, no such sum: refused rather than silently replaced
    by the sum of per-block bounds.  ``clients``: the error names the ``clients=`` argument (federated engines).
    ``extra``: positional arguments after the loss (SVI's ``(model, guide, optim, loss)``): refused, saying so."""
    optimizer = callable(getattr(loss, "init", None)) and callable(getattr(loss, "update", None))
    svi = (f" numpyro.infer.SVI's optimizer argument has no counterpart: {engine} sets its own steps (its step-size "
           "options are keywords); pass the ELBO third." if optimizer else "")
    if extra:
        third = "" if hasattr(loss, "loss") else (f" (the third positional argument is the loss, e.g. Trace_ELBO(); "
                                                  f"got a {type(loss).__name__}"
                                                  + (": client ids go in clients=)" if clients else ")"))
        raise TypeError(f"{engine}(model, guide, loss, *, ...): the options are keyword arguments{third}.{svi}")
    if loss is None:
        return
    if not callable(getattr(loss, "loss", None)):
        hint = (f"; the clients go in clients= (one client id per row of the data plate, a list of index arrays, or "
                f"a ClientData) or num_clients=M — e.g. {engine}(model, guide, Trace_ELBO(), clients=site_ids, ...)"
                if clients else "")
        raise TypeError(f"loss must be a NumPyro ELBO (e.g. Trace_ELBO()), got {type(loss).__name__}{hint}.{svi}")
    if isinstance(getattr(loss, "elbo", loss), RenyiELBO):
        raise ValueError(f"{engine} splits the negative ELBO into a sum over blocks of the data plate (and over "
                         "particles); RenyiELBO's bound is a log-mean-exp over particles of the whole data's weight, "
                         "not such a sum. Use Trace_ELBO, TraceMeanField_ELBO, TraceGraph_ELBO or TraceEnum_ELBO.")


def elbo_loss(elbo, rng_key, param_map, model, guide, *args, **kwargs):
    """``elbo.loss(...)``, with a NumPyro ``Trace_ELBO``'s per-site terms summed in sorted site order.

    ``Trace_ELBO`` sums its sites in the order of a Python ``set`` of their names, which follows the process's string
    hash seed (``PYTHONHASHSEED``, random per process by default): each process traces a differently ordered sum,
    i.e. a different XLA program.  On one process that is float reassociation only; over several processes
    (``jax.distributed``) the processes then run different compiled programs whose collectives pair up wrongly
    (measured, issue 14: λ_0 wrong after 8 PD-VI iterations on 2 CPU processes whenever the two hash seeds gave
    different orders).  Sorted, every process compiles the same program (the lowered text still lists NumPyro's
    per-site subtractions in hash order, which only JAX's persistent cache key sees).  Other ELBOs are called as
    given."""
    if isinstance(elbo, Trace_ELBO) and getattr(elbo, "sum_sites", False) and (
            type(elbo).loss_with_mutable_state is Trace_ELBO.loss_with_mutable_state):
        elbo = copy.copy(elbo)
        elbo.sum_sites = False
        terms = elbo.loss(rng_key, param_map, model, guide, *args, **kwargs)
        return sum((terms[k] for k in sorted(terms)), start=jnp.array(0.0))
    return elbo.loss(rng_key, param_map, model, guide, *args, **kwargs)


class _BlockScale(Messenger):
    """Mask padded data entries, count local terms once and weight global terms by ``global_weight``."""

    def __init__(self, fn, plate_name: str, mask, local_scale: float, global_weight):
        self.plate_name, self.mask = plate_name, mask
        self.local_scale, self.global_weight = local_scale, global_weight
        super().__init__(fn)

    def process_message(self, msg):
        if msg["type"] != "sample":
            return
        frame = next((f for f in msg["cond_indep_stack"] if f.name == self.plate_name), None)
        scale = 1.0 if msg["scale"] is None else msg["scale"]
        if frame is None:
            msg["scale"] = scale * self.global_weight
        else:
            msg["fn"] = msg["fn"].mask(self.mask.reshape((-1,) + (1,) * (-frame.dim - 1)))
            msg["scale"] = scale * self.local_scale  # undoes the plate's N/|b|: local terms count once


class _PinLocal(Messenger):
    """Give local params the rows of the current block directly and stop the plate from slicing them."""

    def __init__(self, fn, values: dict):
        self.values = values
        super().__init__(fn)

    def process_message(self, msg):
        if msg["type"] == "param" and msg["name"] in self.values:
            msg["value"] = self.values[msg["name"]]
            msg["kwargs"] = {**msg["kwargs"], "event_dim": None}


def _masks_of(fn) -> jax.Array | bool:
    """The elementwise mask of a (nested) ``MaskedDistribution`` (``True`` when none)."""
    mask = True
    while isinstance(fn, dist.MaskedDistribution):
        mask = jnp.logical_and(mask, fn._mask)
        fn = fn.base_dist
    return mask


class _ModelMasksOnGuide(Messenger):
    """Mask the guide's density at ``sites`` where the MODEL masks theirs (its own handlers applied: ``model`` is the
    model as the loss runs it).  For numpyro's ``obs_mask=`` (:func:`~numpyro_fedvi.structure.imputation_sites`):
    ``y_unobserved`` at an observed row is no variable of the model (masked out of its density, discarded by the
    deterministic ``y``), and its guide entropy alone would be maximised without bound — NumPyro's ELBO keeps it, and
    PD-VI's Newton steps on the local rows then ran its scale to overflow and the global params with it.  The
    model is traced (blocked from the loss's handlers) only for its masks: its density is not computed."""

    def __init__(self, fn, model, sites):
        self.model, self.sites, self.masks = model, tuple(sites), {}
        super().__init__(fn)

    def __call__(self, *args, **kwargs):
        with handlers.block():  # latents at init_to_uniform: one without a sampler (ImproperUniform) is not drawn
            model = handlers.substitute(handlers.seed(self.model, 0), substitute_fn=init_to_uniform)
            tr = handlers.trace(model).get_trace(*args, **kwargs)
        self.masks = {n: _masks_of(tr[n]["fn"]) for n in self.sites if n in tr}
        return super().__call__(*args, **kwargs)

    def process_message(self, msg):
        if msg["type"] == "sample" and msg["name"] in self.masks:
            msg["fn"] = msg["fn"].mask(self.masks[msg["name"]])


class _StandardOffMask(dist.Distribution):
    """A masked imputation site's density with the standard one at its masked-out entries: ``log p(v)`` where the
    model scores ``v``, else ``log N(u; 0, 1)`` of ``v``'s unconstrained value ``u`` (with its Jacobian: the
    push-forward of N(0, 1) through ``biject_to(support)``)."""

    def __init__(self, masked: dist.MaskedDistribution):
        self.masked, self.scored = masked, _masks_of(masked)
        shape = masked.batch_shape + masked.event_shape
        self.standard = dist.TransformedDistribution(dist.Normal(jnp.zeros(shape), 1.0), dist.biject_to(masked.support))
        super().__init__(masked.batch_shape, masked.event_shape)

    @property
    def support(self):
        return self.masked.support

    def sample(self, key, sample_shape=()):
        return self.masked.sample(key, sample_shape)

    def log_prob(self, value):
        return jnp.where(self.scored, self.masked.log_prob(value), self.standard.log_prob(value))


class _StandardImputedEntries(Messenger):
    """The model with a standard density at the entries of its ``obs_mask`` imputation sites that it masks out (no
    variable of the model, see :class:`_ModelMasksOnGuide`), for a guide that draws them inside a JOINT latent
    (``AutoMultivariateNormal``, MPSGD's ``AutoLocationScale``), whose density cannot leave them out: the target
    becomes ``p(θ, y_mis) · Π N(u_j; 0, 1)``, a product, so the best Gaussian is q(θ, y_mis) ⊗ N(0, 1) with q(θ, y_mis)
    the best one without them.  Without it their entropy alone grows without bound (FedSVI with an
    AutoMultivariateNormal: −ELBO −7.6e22; MPSGD: q(σ) infinite after 3,200 steps)."""

    def __init__(self, fn, sites):
        self.sites = tuple(sites)
        super().__init__(fn)

    def process_message(self, msg):
        if (msg["type"] == "sample" and msg["name"] in self.sites and isinstance(msg["fn"], dist.MaskedDistribution)
                and not msg["fn"].event_shape):
            msg["fn"] = _StandardOffMask(msg["fn"])


def without_imputed_entries(model, guide, sites, jointly: bool):
    """``(model, guide)`` that leave the masked-out entries of the model's ``obs_mask`` imputation ``sites``
    (:func:`~numpyro_fedvi.structure.imputation_sites`) out of the objective: the guide's density masked there
    (:class:`_ModelMasksOnGuide`), or — a guide that draws them in a joint latent (``jointly``,
    :func:`~numpyro_fedvi.structure.drawn_jointly`) — the model given a standard density there
    (:class:`_StandardImputedEntries`).  As they are without such sites."""
    if not sites:
        return model, guide
    if jointly:
        return _StandardImputedEntries(model, sites), guide
    return model, _ModelMasksOnGuide(guide, model, sites)


def with_draw_layout(elbo, structure: ModelStructure):
    """``elbo``, or for controlled draws (``elbo.freeze``) a copy told the model's layout: the data plate's name when
    they name none (``ControlledDraws(local_plate=None)``: every plated site counted as local, as the federated
    engines' oracles are built before the model is traced), so that global sites in other plates are drawn as
    global vectors, and the sites among them whose slices the data couple (``structure.coupled_globals``), which the
    particle rules count like unplated vectors."""
    if not hasattr(elbo, "freeze"):
        return elbo
    elbo = copy.copy(elbo)
    elbo.local_plate = elbo.local_plate or structure.data_plate.name
    elbo.coupled = elbo.coupled | structure.coupled_globals
    return elbo


def block_loss_fn(elbo, model, guide, structure: ModelStructure, static_kwargs: dict | None = None) -> Callable:
    """Return ``loss(rng_key, global_unc, local_rows_unc, idx, mask, weight, args, kwargs)``.

    ``global_unc``: unconstrained global params; ``local_rows_unc``: canonical (rows-first) unconstrained
    local params of the block's ``P = len(idx)`` rows; ``idx``: data indices (padded), ``mask``: real
    entries; ``weight``: the weight of the global terms (``|b|/N`` for a PD-VI block; a client's unbiased estimate
    of the full-data negative ELBO is ``(N/|b|)·loss`` with ``weight = |b|/N``, :func:`client_loss_from_blocks`).
    Each real row's terms count once, with a Python-number scale (``TraceEnum_ELBO`` needs one on the sites it
    enumerates).

    Two paths, chosen by how the model declares its data plate:
    - subsampled plate (``plate("data", N, subsample_size=...)``): the block's indices are pinned on the plate of
      model and guide (``substitute``), so the model sees only the block's rows — O(|b|);
    - plain plate (``plate("data", N)`` around ``obs=y``): the model runs on all N rows and every site in the plate
      is masked to the block — correct for any model, O(N) per evaluation; local params are given as the full
      table with the block's rows filled in (other rows are masked out and never seen by the loss).

    ``loss.freeze`` (same arguments) returns the key with the block's Monte-Carlo draws computed once when ``elbo``
    can (``elbo.freeze``: :class:`~numpyro_fedvi.particles.ControlledDraws`), else the key itself;
    ``loss(loss.freeze(key, ...), ...)`` equals ``loss(key, ...)`` at any params, and a solver that evaluates the
    block at many points of one key then draws once.
    """
    plate = structure.data_plate
    static_kwargs = dict(static_kwargs or {})
    elbo = with_draw_layout(elbo, structure)

    def on_block(fn, rng_key, global_unc, local_rows_unc, idx, mask, weight, args, kwargs):
        """``fn(rng_key, constrained global params, model, guide, *args, **kwargs)`` with model and guide restricted
        to the block (``elbo_loss`` for the loss, ``elbo.freeze`` for its draws)."""
        params = structure.constrain_global(global_unc)
        if plate.subsampled:
            local = structure.constrain_local(local_rows_unc)
            site_mask, local_scale = mask, idx.shape[0] / plate.size  # undoes the plate's N/|b|
            pinned = {plate.name: idx}
            m, g = handlers.substitute(model, data=pinned), handlers.substitute(guide, data=pinned)
        else:
            target = jnp.where(mask, idx, plate.size)
            site_mask = jnp.zeros(plate.size, jnp.int32).at[target].add(1, mode="drop") > 0
            full = {k: jnp.zeros((plate.size,) + v.shape[1:], v.dtype).at[target].set(v, mode="drop")
                    for k, v in local_rows_unc.items()}
            local, local_scale, m, g = structure.constrain_local(full), 1.0, model, guide
        m, g = without_imputed_entries(m, g, *structure.imputation)  # in the block mask: other rows stay out
        m = _BlockScale(_PinLocal(m, local), plate.name, site_mask, local_scale, weight)
        g = _BlockScale(_PinLocal(g, local), plate.name, site_mask, local_scale, weight)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="subsample_size does not match")
            return fn(rng_key, params, m, g, *args, **kwargs, **static_kwargs)

    def loss(rng_key, global_unc, local_rows_unc, idx, mask, weight, args, kwargs):
        return on_block(lambda *a, **kw: elbo_loss(elbo, *a, **kw), rng_key, global_unc, local_rows_unc, idx, mask,
                        weight, args, kwargs)

    def freeze(rng_key, global_unc, local_rows_unc, idx, mask, weight, args, kwargs):
        if not hasattr(elbo, "freeze"):
            return rng_key
        return on_block(elbo.freeze, rng_key, global_unc, local_rows_unc, idx, mask, weight, args, kwargs)

    loss.freeze = freeze
    return loss


def full_loss_fn(block_loss: Callable, structure: ModelStructure, partitions: Partitions) -> Callable:
    """``loss(rng_key, global_unc, local_unc, args, kwargs)``: the full-data negative ELBO as ``Σ_b f_b``.

    Blocks are evaluated one after another with ``lax.map`` (memory of one block), all with the same key; a model
    with an unsubsampled data plate is evaluated once on all rows.
    """
    size = structure.data_plate.size

    def loss(rng_key, global_unc, local_unc, args, kwargs):
        if not structure.data_plate.subsampled:
            return block_loss(rng_key, global_unc, local_unc, jnp.arange(size), jnp.ones(size, bool), 1.0, args,
                              kwargs)

        def one(block):
            idx, mask, n_b = block
            rows = {k: v[idx] for k, v in local_unc.items()}
            return block_loss(rng_key, global_unc, rows, idx, mask, n_b / size, args, kwargs)

        return jnp.sum(jax.lax.map(one, (partitions.indices, partitions.mask, partitions.sizes)))

    return loss


def client_loss_fn(elbo, model, guide, structure, data_plate: str, num_total: int, args=(), kwargs=None) -> Callable:
    """``loss(rng_key, theta_unconstrained, rows, mask)``: one client's share of the federated negative ELBO.

    The user's ELBO on the client's ``rows`` with every site inside ``data_plate`` scaled by ``num_total / Σ mask``
    (padded rows masked) and the global terms (prior, global KL) counted once, so that with ``μ_i = N_i/N`` the
    weighted sum ``Σ_i μ_i loss_i`` is the full-data negative ELBO in expectation (specs/fedmm.md "Pitfalls";
    used by FedSVI and FedLocalVI).  ``theta`` are the unconstrained GLOBAL params of ``structure``."""
    kwargs = dict(kwargs or {})
    elbo = with_draw_layout(elbo, structure)

    def loss(rng_key, theta, rows, mask, *_):
        scale = num_total / jnp.maximum(jnp.sum(mask), 1)
        # scale · (data-plate terms + global terms / scale): the traced factor stays off the data-plate sites, whose
        # scale TraceEnum_ELBO needs as a Python number (it marginalises enumerated local latents there)
        m, g = without_imputed_entries(model, guide, *structure.imputation)
        m, g = (_BlockScale(f, data_plate, mask, 1.0, 1.0 / scale) for f in (m, g))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="subsample_size does not match")
            return scale * elbo_loss(elbo, rng_key, structure.constrain_global(theta), m, g, rows, *args, **kwargs)

    return loss


def client_loss_from_blocks(block_loss: Callable, num_total: int, args=(), kwargs=None) -> Callable:
    """``loss(rng_key, theta_unconstrained, idx, mask)``: one client's share of the federated negative ELBO when the
    client is a block of the user's data plate (``FedSVI(..., clients=ids)``) — ``client_loss_fn``'s contract with the
    client's rows given as data-plate INDICES ``idx`` (padded; ``mask`` True on real rows).

    ``block_loss`` (:func:`block_loss_fn`) on ``idx`` with every data-plate term counted ``num_total / Σ mask`` times
    and the global terms (prior, global KL) once: an unbiased estimate of the full-data negative ELBO, and with
    ``μ_i = N_i/N`` the sum ``Σ_i μ_i loss_i`` is the full-data negative ELBO.  O(rows) through the plate's indices
    when the data plate is subsampled, O(N) through a mask otherwise (then ``idx`` must not repeat a row: draw
    minibatches without replacement).  Global-only guides (no local params)."""
    kwargs = dict(kwargs or {})

    def loss(rng_key, theta, idx, mask, *_):
        local_weight = num_total / jnp.maximum(jnp.sum(mask), 1)
        # local_weight · (block terms + global terms / local_weight), as client_loss_fn: no traced scale on the
        # data-plate sites (TraceEnum_ELBO needs theirs as a Python number)
        return local_weight * block_loss(rng_key, theta, {}, idx, mask, 1.0 / local_weight, args, kwargs)

    return loss
