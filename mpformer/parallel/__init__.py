"""Runtime parallelism: process groups, the device, autograd collectives, tensor-parallel contexts,
dropout RNG streams and the multi-process harness. The pure layout rules it runs are in :mod:`mpformer.core`;
gradient reduction is the gradient engine's (:mod:`mpformer.optim.engine`)."""
