"""Runtime parallelism: process groups, the device, autograd collectives, TP/DP helpers, RNG streams
and the multi-process harness. The pure layout rules it runs are in :mod:`mpformer.core`."""
