"""Prompt sets, prompt batches, resumable records, and answering a prompt set with a target."""
