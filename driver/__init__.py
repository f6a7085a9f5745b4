"""The run driver: the one package that knows trainer, rollout and weight_sync, and wires them into the RL loop.

``rl_align.py`` parses the command line and the recipe, then calls :func:`driver.run.run`.
"""
