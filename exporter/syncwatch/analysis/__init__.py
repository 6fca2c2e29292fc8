"""Analysis commands: ``syncwatch jct``, ``project``, ``diagnose``, ``report``.

The models are plain functions over plain numbers (``collectives``, ``orderstats``, ``checkpoint``)
so they can be tested against worked figures; each command module holds its CLI wiring.
"""
