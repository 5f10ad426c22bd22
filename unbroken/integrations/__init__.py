"""Fault tolerance for the trainers users already have: Hugging Face Accelerate
(:mod:`unbroken.integrations.accelerate`). Each module imports its framework only when used."""
