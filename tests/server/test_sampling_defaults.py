"""Requests that leave sampling fields out get the model's recommended sampling; /v1/models says which and whence."""
import httpx

from kvforge.sampling_params import SamplingParams


def test_models_card_names_the_sampling_defaults_and_their_source(server):
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["sampling_defaults"] == {"temperature": 0.2, "top_p": 0.9, "top_k": -1, "min_p": 0.0,
                                         "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
    assert "SmolLM2-135M-Instruct model card" in card["sampling_defaults_source"]


def test_unset_fields_take_the_recommended_sampling_and_set_ones_are_kept(client, model_name, offline):
    prompt = "Once upon a time"
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=12, seed=7)
    assert r.choices[0].text == offline.generate(prompt, SamplingParams(max_tokens=12, seed=7, temperature=0.2,
                                                                        top_p=0.9))[0].text
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=12, seed=7, temperature=1.0,
                                  extra_body={"min_p": 0.05})
    assert r.choices[0].text == offline.generate(prompt, SamplingParams(max_tokens=12, seed=7, temperature=1.0,
                                                                        top_p=0.9, min_p=0.05))[0].text
