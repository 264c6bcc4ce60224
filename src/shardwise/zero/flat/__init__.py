"""ZeRO stages 0-2: full parameters on every rank, gradients in flat buckets reduced as they fill, and the
updated slices gathered behind the next forward."""
