"""One file per rule, nothing else to edit: `registry.load_rules()` imports every module in this folder
(and in any folder appended to `__path__`). A module whose name does not start with `_` must register
at least one rule with `torchspeed.doctor.registry.register`, or loading fails naming the file.
"""
