"""How a plan travels in a command: `args.plan_zlib`, its JSON compressed, in base64.

A plan has a member per replica in each data-parallel group of its delta, so it grows
with the job (76-82 kB of JSON at 2,048 machines, by the machines' names), and the executor sends it to every machine of
the delta in each round of a migration, to every machine of the job in a recovery: as
JSON text in every command, it was most of the bus's bytes and of the executor's CPU
(the same text escaped into each command). Its members repeat, so compressed it is
about a twelfth of that. The receiver decodes each plan once: the commands of one
migration carry the same text.
"""

from __future__ import annotations

import base64
import binascii
import functools
import zlib

from trainmover.messages import MAX_MESSAGE_BYTES, Command, Plan, decode

PLAN_ARG = "plan_zlib"


def plan_args(plan: Plan) -> dict[str, str]:
    """The args that carry `plan` in a command (encode once, send in many)."""
    packed = zlib.compress(plan.model_dump_json().encode(), 6)
    return {PLAN_ARG: base64.b64encode(packed).decode("ascii")}


def plan_of(command: Command) -> Plan:
    """The plan a command carries; a clear error naming the command when it has none or
    it does not decode."""
    text = command.args.get(PLAN_ARG)
    if not isinstance(text, str):
        raise ValueError(
            f"{command.op} {command.command_id}: needs args.{PLAN_ARG}, the plan's JSON "
            "compressed with zlib, in base64"
        )
    try:
        return _unpack(text)
    except (binascii.Error, zlib.error, UnicodeDecodeError) as err:
        raise ValueError(
            f"{command.op} {command.command_id}: args.{PLAN_ARG} is not zlib in base64: {err}"
        ) from err


@functools.lru_cache(maxsize=16)
def _unpack(text: str) -> Plan:
    # Plans are frozen; sharing one decoded plan between commands is safe. Inflated at
    # most one byte past the message limit, so that `decode` refuses an oversized plan
    # by its size and a small text cannot inflate without bound.
    inflate = zlib.decompressobj()
    raw = inflate.decompress(base64.b64decode(text, validate=True), MAX_MESSAGE_BYTES + 1)
    return decode(Plan, raw.decode())
