"""The auto-configurator: clusters, a memory model and (next) a calibrated cost model and search."""
