"""Random effects at large N on one accelerator: default PD-VI vs SVI + Adam, 60 epochs, one run each.

``python -m benchmarks.random_effects_large [N ...]`` (default N = 10⁶ and 10⁷; made for a GPU, where the full
benchmark's learning-rate grid and fresh processes cost device time for no new information).  The model, data,
blocks, metrics and SVI set-up are ``benchmarks.random_effects``'s: ``PDVI(model, AutoNormal(model),
num_partitions=20, partitions_per_step=2)`` with every other default, against ``SVI`` + ``optax.adam(0.03)`` (the
full benchmark's best learning rate) on N/10 iid minibatches.  Printed per method: the first epoch (compilation
included), the next 59 epochs' time per epoch, the stop reason and the errors against the closed-form optimum.
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import random
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoNormal

import numpyro_fedvi as nfv
from benchmarks import random_effects as rb
from benchmarks._common import Timer, block

EPOCHS = 60


def _timed(fn):
    with Timer() as t:
        out = block(fn())
    return out, t.seconds


def _report(n, name, first, rest, errors, extra=""):
    print(f"N={n:.0e} {name}: first epoch (compile) {first:.1f} s, {EPOCHS - 1} epochs {rest:.2f} s "
          f"({rest / (EPOCHS - 1) * 1e3:.1f} ms/epoch){extra}: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()),
          flush=True)


def bench(n, seed=0):
    x = jnp.asarray(rb.make_data(n, seed))
    x64 = np.asarray(x, np.float64)
    opt = rb.optimum(x64)
    opt_ne = rb.neg_elbo(x64, opt)
    steps, batch = rb.STEPS_PER_EPOCH, n // rb.STEPS_PER_EPOCH
    engine = nfv.PDVI(rb.model, AutoNormal(rb.model), num_partitions=rb.NUM_PARTITIONS,
                      partitions_per_step=rb.PARTITIONS_PER_STEP)
    res, first = _timed(lambda: engine.run(random.key(seed), steps, x, batch_size=batch, progress_bar=False))
    res, rest = _timed(lambda: engine.run(random.key(seed), steps * (EPOCHS - 1), x, batch_size=batch,
                                          progress_bar=False, init_state=res.state))
    _report(n, "PD-VI", first, rest, rb.metrics(x64, opt, opt_ne, engine.get_params(res.state)),
            f", {res.diagnostics['stop_reason']}")

    svi = SVI(rb.pinned(rb.model), AutoNormal(rb.pinned(rb.model)), optax.adam(0.03), Trace_ELBO())
    epoch = rb.svi_epoch_fn(svi, n, batch)
    state = svi.init(random.key(seed), x, jnp.arange(batch))
    (state, _), first = _timed(lambda: epoch(state, random.key(seed + 1), x))

    def rest_epochs(state=state):
        for e in range(1, EPOCHS):
            state, _ = epoch(state, random.fold_in(random.key(seed + 1), e), x)
        return state
    state, rest = _timed(rest_epochs)
    _report(n, "SVI + Adam(0.03)", first, rest, rb.metrics(x64, opt, opt_ne, svi.get_params(state)))


def main(argv=None):
    sizes = [int(float(a)) for a in (sys.argv[1:] if argv is None else argv)] or [10**6, 10**7]
    print(jax.devices(), flush=True)
    for n in sizes:
        bench(n)


if __name__ == "__main__":
    main()
