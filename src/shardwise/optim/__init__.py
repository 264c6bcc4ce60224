"""The math around the optimizer step: building or wrapping the optimizer, the precision policy and loss scaler,
DeepSpeed's learning-rate schedules, and one parameter's optimizer state."""
