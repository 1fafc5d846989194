"""The composition layer: the `rlgateway` command and what puts the gateway and the trainer
together (the demo, `serve --train`'s embedded trainer, `build_trainer`). Nothing imports it;
it imports `gateway/`, `trainer/`, `engines/` and `store/`."""
