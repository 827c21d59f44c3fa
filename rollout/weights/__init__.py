"""The weight routes from the trainer to the engines, and the engine side that receives them: see
routes.py for the interface and the registry, codec.py for what every route shares."""
