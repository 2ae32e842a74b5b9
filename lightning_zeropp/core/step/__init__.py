"""Step: what one training step needs around the schedule. `batch` checks and slices a rank's
batch and lets the ranks agree on it; `grads` holds a step's gradients for the front to scale and
clips by the global norm; `loss` routes the schedule's loss calls and sends the step's loss
to every rank; `nonfinite` watches for inf/NaN; `failure` turns one rank's error into a
named error on every rank (the failure board; `failure_errors` holds what it raises, `roll`
calls the roll of live ranks, `store` gives every store call a deadline, `sockets` wakes the
ranks blocked on this one); `agree` compares
what every rank must share (settings, the model's cut, replicas' weights); `preempt` records
SIGTERM, which the step's agreement turns into a stop on every rank; `pipeline_batch` gives
every stage of a pipeline its first stage's batch (random collators) and checks it.
"""
