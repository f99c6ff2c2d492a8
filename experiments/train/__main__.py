"""``python -m experiments.train drafter=medusa|eagle [model=...] [overrides]``: see
:mod:`experiments.train.main`."""

from experiments.train.main import main

if __name__ == "__main__":
    main()
