"""The training objectives, one per head type: :mod:`.medusa` and :mod:`.eagle`."""
