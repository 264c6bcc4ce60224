"""Communication between ranks: the one place that calls ``torch.distributed`` (:class:`~.distributed.Comm`),
the shared-memory transport of CPU ranks, the store-based agreement of collective calls, the checks that every
rank built the same engine, and where a launch's ranks run."""
