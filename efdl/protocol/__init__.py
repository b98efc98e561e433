"""What a node agent and its workers say to each other: every message a frozen dataclass with
one encoding (:mod:`efdl.protocol.messages`). The agent's end and the worker's end of the
socket (:mod:`efdl.worker.channel`) carry them; neither writes a message by hand."""
