"""Reports how this env process is laid out: its personality flags and where None lives.

``id(None)`` is the address of a static object in the interpreter's image, so two envs
report the same one exactly when their address-space layouts are not randomized apart.
"""

from boltzlabs_gym.env import serve


def layout():
    with open("/proc/self/personality") as f:
        personality = int(f.read(), 16)
    return {"personality": personality, "none_at": id(None)}


serve(reset=lambda seed: layout(), step=lambda action: (layout(), 0.0, False, {}))
