"""Training the drafter: self-distillation data (`distill`) and prompt loading (`data`)."""
