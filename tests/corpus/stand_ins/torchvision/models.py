"""No models: names resolve (libraries import them when torchvision is installed) but cannot be built."""


def __getattr__(name):
    def unavailable(*args, **kwargs):
        raise RuntimeError(f"torchvision.models.{name} is not part of the corpus stand-in")

    return unavailable
