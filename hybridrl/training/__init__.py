"""The training side's engine protocol (`protocol.TrainEngine`) and the registry of training engines."""
