"""Every stage on one slide folder, in one work directory (`wsidino pipeline`, the `pipeline` flow)."""
