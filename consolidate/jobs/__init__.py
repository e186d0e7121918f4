"""Thin Hydra entry points. Each ``main`` composes the config and calls a plain function
(``run_*``) that tests call directly with a composed config."""
