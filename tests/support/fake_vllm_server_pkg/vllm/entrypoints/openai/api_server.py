"""`python -m vllm.entrypoints.openai.api_server` played by the faithful fake vLLM server
(`tests/support/fake_vllm.py`: real generation with the tiny model, weight updates, version
labels), for tests that start servers the way a user's deployment does, by vLLM's own command
line (`engines.vllm_launch.vllm_command`): put this folder and the repository on PYTHONPATH."""

from tests.support.fake_vllm import main

if __name__ == "__main__":
    main()
