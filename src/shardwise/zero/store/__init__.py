"""This rank's fp32 master weights and optimizer state, for every ZeRO stage, and where they live."""
