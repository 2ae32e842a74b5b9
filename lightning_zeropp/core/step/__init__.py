"""Step: what one training step needs around the schedule. `batch` checks and slices a rank's
batch and lets the ranks agree on it; `grads` holds a step's gradients for the front to scale and
clips by the global norm; `nonfinite` watches for inf/NaN; `failure` turns one rank's error into a
named error on every rank (the failure board).
"""
