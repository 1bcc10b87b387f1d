"""``python -m titan_core.config.manager``: torchtitan's door to the job config, kept as an alias
of ``titan config`` (print the resolved config as TOML; ``--help`` lists every key).

The config layer itself is ``schema`` (keys, values, validation), ``argv`` and ``toml`` (reading
the command line and TOML files), ``help``; the resolver that layers a recipe, a TOML file and
overrides is ``titan_core.resolve`` (it sits above the model families that define recipes).
"""

PROG = "python -m titan_core.config.manager"

if __name__ == "__main__":  # an entry point only: importing this module imports nothing above
    import sys

    from titan_core.cli.config import config_main

    sys.exit(config_main(sys.argv[1:], prog=PROG))
