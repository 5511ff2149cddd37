"""Training the drafter and the companion: self-distillation data (`distill`, `synthesize`), drafter training
(`train_drafter` and its parts), the companion (`train_companion`) and the acceptance tables (`calibrate`)."""
