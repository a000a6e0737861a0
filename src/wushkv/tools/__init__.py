"""User tools behind ``wushkv calibration``, ``wushkv data`` and ``wushkv merge``: upgrading an old calibration
file (:mod:`.upgrade`), writing held-out text (:mod:`.heldout`) and merging runs made in parallel (:mod:`.merge`).
The argument parsing lives in :mod:`wushkv.cli.tools`; these modules hold the logic and are importable on their own."""
