"""syncwatch: make synchronization coupling in distributed training visible and alertable."""

__version__ = "0.1.0"
