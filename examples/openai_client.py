"""The official ``openai`` client talking to ``minivllm serve``: a completion, a chat, and
a chat streamed token by token.

Start the server in one terminal (the bundled model, loopback only), then run this:

    minivllm serve --api-key secret
    python examples/openai_client.py --api-key secret
    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1 --model bundled
"""
import argparse

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="none", help="the server's --api-key (any string if it has none)")
    parser.add_argument("--model", default=None, help="default: the first model the server lists")
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = args.model or client.models.list().data[0].id
    print(f"model: {model}\n")

    # 1. A plain completion: the prompt is continued.
    completion = client.completions.create(model=model, prompt="It is a truth universally acknowledged,",
                                           max_tokens=32, temperature=0.7, seed=0)
    print("completion:", completion.choices[0].text)
    print("  finish_reason:", completion.choices[0].finish_reason, "| usage:", completion.usage, "\n")

    # 2. A chat: the server applies the model's chat template to the messages.
    messages = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "Who is the lady's sister?"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0.7, seed=0)
    print("chat:", chat.choices[0].message.content, "\n")

    # 3. The same chat, streamed: each chunk carries the text of one engine step.
    print("streamed: ", end="", flush=True)
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0.7, seed=0,
                                            stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
