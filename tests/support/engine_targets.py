"""A stand-in library for engine tests (patched instead of accelerate), and wrappers for it."""


class Engine:
    def run(self, x, *, scale=1):
        return x * scale


def helper(x):
    return x + 1


def double_result(wrapped, instance, args, kwargs):
    return 2 * wrapped(*args, **kwargs)


def add_ten(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs) + 10


NOT_CALLABLE = 3
