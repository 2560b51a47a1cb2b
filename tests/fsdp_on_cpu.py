"""``python tests/fsdp_on_cpu.py pretrain ...`` under torchrun: mlmlab with accelerate's FSDP on CPU.

For tests only. accelerate (1.15) honours an FSDP config only on accelerators: on CPU it
keeps ``distributed_type`` MULTI_CPU and quietly runs DDP. torch's FSDP2 itself shards
on CPU (gloo), so this launcher lets AcceleratorState keep the FSDP plugin that the
Accelerator built from the ACCELERATE_USE_FSDP / FSDP_* variables, as it does on a GPU.
Everything after that is accelerate's and torch's own FSDP code.
"""

import sys

from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType

from mlmlab.cli import main

_accelerator_state_init = AcceleratorState.__init__


def _init_keeping_fsdp(self, *args, fsdp_plugin=None, **kwargs):
    _accelerator_state_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        # Both shared states: each later AcceleratorState() copies PartialState's over its own.
        PartialState().distributed_type = self.distributed_type = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin


AcceleratorState.__init__ = _init_keeping_fsdp

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))  # with argv: no re-exec, which would drop the patch
