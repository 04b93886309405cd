"""The broker's UDP data path (the Aeron transport inside the broker, docs/transport.md).

``datapath.DataPath`` is sans-IO: it sorts every datagram of the broker's one UDP endpoint to the
ingress (images of the publications producers registered over TCP, ``ingress.py``) or the egress
(the broker's publications to UDP consumers, ``egress.py``), refuses and counts everything else, and
returns the datagrams to send. ``shell.UdpShell`` is the trio task around it (the only module here that
imports trio or socket).
"""

from flowbroker.broker.udp.datapath import DataPath, DataPathStatistics

__all__ = ["DataPath", "DataPathStatistics"]
