"""`python -m hf_specformer.train ...` / `accelerate launch -m hf_specformer.train ...`: trains a SpecFormer drafter.

See `hf_specformer.training.train_drafter` for the options (`--help`).
"""

from .training.train_drafter import main

if __name__ == "__main__":
    main()
