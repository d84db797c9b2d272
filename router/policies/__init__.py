"""The routing policies, one module each (round_robin, least_loaded, prefix_aware), behind the
Policy protocol (base.py); registry.py maps the name --policy gives to its class."""
